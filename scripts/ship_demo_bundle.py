"""Export the embedded demo pair into the bundle that ships with the package (specdeploy/demo/demo-bundle).

    python scripts/ship_demo_bundle.py      # `make demo-bundle`; needs the export extra

A runtime-only install (`pip install specdeploy`, no torch) runs this bundle when no other is named.
It is `specdeploy export` of specdeploy/demo/target and draft with no other option, with one change:
the strings of the manifest that name this checkout (each model's `source`, a tokenizer host's
reason) name it relative to the checkout, so that the package records no path of the machine that
built it. tests/test_shipped_bundle.py checks it against a fresh export. Run this again after the
demo pair or the export stage changes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdeploy.bundle import MANIFEST_NAME, load_manifest, manifest_from_dict, save_manifest
from specdeploy.defaults import SHIPPED_BUNDLE, demo_checkpoints
from specdeploy.export import ExportConfig, export_bundle

ROOT = Path(__file__).resolve().parents[1]


def relative_strings(value, prefix: str):
    """value (parsed JSON) with every string's `prefix` removed."""
    if isinstance(value, str):
        return value.replace(prefix, "")
    if isinstance(value, list):
        return [relative_strings(item, prefix) for item in value]
    if isinstance(value, dict):
        return {key: relative_strings(item, prefix) for key, item in value.items()}
    return value


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    target, draft = demo_checkpoints()
    export_bundle(ExportConfig(target=target, draft=draft, out=str(SHIPPED_BUNDLE), force=True),
                  lambda stage, detail: print(f"{stage:<8} {detail}"))
    data = json.loads((SHIPPED_BUNDLE / MANIFEST_NAME).read_text(encoding="utf-8"))
    save_manifest(manifest_from_dict(relative_strings(data, f"{ROOT}/")), SHIPPED_BUNDLE)
    load_manifest(SHIPPED_BUNDLE, verify=True)
    size = sum(path.stat().st_size for path in SHIPPED_BUNDLE.rglob("*") if path.is_file())
    print(f"{SHIPPED_BUNDLE.relative_to(ROOT)}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
