"""The compiled-layers series of the max-tokens table in one JSON, for ``bench_max_tokens.py --plot-only``,
which redraws it in place (adding the summary and the goals) with its markdown and PNG:
HF's own loss from run78 (its FLCEMixin tries there, at an older commit, are left out), Liger from run89
call 2, FLCEMixin from run89 calls 1 and 3. Every try is copied as recorded; ``sources`` names each one's file.

    python benchmarks/results/<this run>/compiled_all/merge.py
    OUT=benchmarks/results/<this run>/compiled_all python benchmarks/bench_max_tokens.py \
        --plot-only benchmarks/results/<this run>/compiled_all/max_tokens_compiled_all.json --tag _compiled_all
"""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parents[1]
RUN78 = (
    RESULTS
    / "2026-12-02_h200_torch2.11_triton3.6_run78_compile_max_batch_e2e_3b"
    / "mt"
    / "max_tokens_compile.json"
)
SOURCES = [
    (RUN78, {"hf"}),
    (HERE.parent / "call2" / "mtl" / "max_tokens_compiled_liger.json", {"liger"}),
    (HERE.parent / "call1" / "mtc" / "max_tokens_compiled.json", {"flce"}),
    (HERE.parent / "call3" / "mt23" / "max_tokens_compiled23.json", {"flce"}),
]

payloads = [(json.loads(path.read_text()), providers, path) for path, providers in SOURCES]
first = payloads[0][0]
for payload, _, path in payloads:  # one setup: the same model, precision, sequence and compiled layers
    for key in ("model", "precision", "seq_len_batch_axis", "compile_layers"):
        assert payload["meta"][key] == first["meta"][key], (path, key)
tries, sources = [], []
for payload, providers, path in payloads:
    mine = [t for t in payload["tries"] if t["provider"] in providers]
    tries += mine
    sources.append({"file": str(path.relative_to(RESULTS)), "providers": sorted(providers), "tries": len(mine),
                    "commit": payload["env"]["lightning_flce_commit"]})  # fmt: skip
merged = {"env": payloads[1][0]["env"], "meta": first["meta"], "tries": tries, "sources": sources}
(HERE / "max_tokens_compiled_all.json").write_text(json.dumps(merged, indent=1) + "\n")
print(f"{len(tries)} tries from {len(sources)} files -> {HERE / 'max_tokens_compiled_all.json'}")
