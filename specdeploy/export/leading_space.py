"""A reply keeps the space its first token starts with.

The runtime and every host decode only a reply's ids. The tokenizer.json decoders of Llama 2, Mistral
and Phi-3 end with Strip(" ", 1, 0), and a Metaspace decoder whose prepend_scheme is "first" or
"always" drops the space as well: they were written to decode whole texts, whose first space the
tokenizer prepended itself. A reply that starts with `▁Paris` then reads "Paris", and prompt plus
reply "...isParis", where llama-server and vLLM give " Paris". Export writes the bundle's decoder
without that step (special_tokens.py reports it as a repair).
"""

from __future__ import annotations

import copy


def unstripped(decoder) -> dict | None:
    """tokenizer.json's decoder without the step that drops the space its text starts with; None when it has none."""
    if not isinstance(decoder, dict):
        return None
    kind = decoder.get("type")
    if kind == "Sequence":
        steps = decoder.get("decoders") or []
        changed = [unstripped(step) or step for step in steps]
        if all(a is b for a, b in zip(changed, steps)):
            return None
        return {**decoder, "decoders": [step for step in changed if step != _NOTHING]}
    if _strips(decoder):  # a Strip that also trims the end keeps that part
        return {**decoder, "start": 0} if (decoder.get("stop") or 0) > 0 else dict(_NOTHING)
    if kind == "Metaspace" and (decoder.get("prepend_scheme") in ("first", "always")
                                or ("prepend_scheme" not in decoder and decoder.get("add_prefix_space"))):
        fixed = copy.deepcopy(decoder)
        fixed["prepend_scheme"] = "never"
        if "add_prefix_space" in fixed:
            fixed["add_prefix_space"] = False
        return fixed
    return None


_NOTHING = {"type": "Sequence", "decoders": []}


def _strips(step) -> bool:
    """A Strip step that removes spaces from the start of the text."""
    return (isinstance(step, dict) and step.get("type") == "Strip" and step.get("content") == " "
            and (step.get("start") or 0) > 0)
