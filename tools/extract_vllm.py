"""Extract the vLLM kernels that bench's `vllm` baseline runs into a folder for FFNQ_VLLM_DIR.

    pip download --no-deps vllm==0.34.0 -d /tmp/vllm          # a wheel (~240 MB), or a clone
    python tools/extract_vllm.py /tmp/vllm/vllm-0.34.0-*.whl   # writes third_party/vllm
    export FFNQ_VLLM_DIR=$PWD/third_party/vllm

vLLM ships no tuned launch config for MiniMax-M2's expert shapes, so bench's first vLLM run on a
GPU sweeps benchmark_moe.py's space (minutes) and writes one into that folder. `--configs-from
REPORT` writes instead the configs a bench report's vLLM ran (e.g. configs/gates/ref/h100-tp1-bench):
a rerun then times vLLM as that run did.

The folder holds vLLM's own code, unchanged but for its imports (vLLM's code is not part of
ffnq; third_party/ is ignored by git):
  fused_moe.py   fused_moe_kernel and the @triton.jit functions it calls (fused_moe.py)
  fp8_quant.py   _per_token_group_quant_fp8 (quantization/utils/fp8_utils.py)
  configs/       the tuned launch configs vLLM ships (fused_moe/configs/*.json)
  SOURCE.txt     where they came from and the release, which bench's report names
Only the Triton functions are taken, with `import triton` / `import triton.language as tl`
above them: the rest of vLLM (and its CUDA extensions) is not needed to run them.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import zipfile
from pathlib import Path

from ffnq.baselines.vllm import tuned_entry  # the vllm_config cells bench writes

MOE = "vllm/model_executor/layers/fused_moe/fused_moe.py"
QUANT = "vllm/model_executor/layers/quantization/utils/fp8_utils.py"
CONFIGS = "vllm/model_executor/layers/fused_moe/configs/"
VERSION = "vllm/_version.py"
HEADER = "import triton\nimport triton.language as tl\n"


class Refused(Exception):
    """A source this script cannot take: one line, exit 2, nothing written."""


class Source:
    """A vLLM wheel or source tree, read by path inside it."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.zip = zipfile.ZipFile(path) if path.is_file() else None
        except zipfile.BadZipFile:
            raise Refused(f"{path} is not a wheel (a zip file) nor a vLLM source tree") from None
        self.members = set(self.zip.namelist()) if self.zip else set()  # one listing, not one a read
        if self.zip is None and not (path / MOE).is_file():
            raise Refused(f"{path} is neither a vLLM wheel nor a tree holding {MOE}")

    def names(self) -> list[str]:
        if self.zip:
            return sorted(self.members)
        return [str(p.relative_to(self.path)) for p in self.path.rglob("*") if p.is_file()]

    def read(self, name: str) -> str | None:
        if self.zip:
            return self.zip.read(name).decode() if name in self.members else None
        p = self.path / name
        return p.read_text() if p.is_file() else None


def jit_closure(src: str, roots: list[str], where: str) -> str:
    """``roots`` and every top-level function or constant they name, transitively, in source
    order: one module that needs only triton."""
    tree = ast.parse(src)
    defs: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    defs[t.id] = node
    missing = [r for r in roots if r not in defs]
    if missing:
        raise Refused(f"{where} defines no {', '.join(missing)} at its top level")
    want, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in want:
            continue
        want.add(name)
        todo += [n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name) and n.id in defs]
    lines = src.splitlines()
    nodes = [n for n in tree.body if any(defs.get(k) is n for k in want)]
    text = ["\n".join(lines[min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])]) - 1:n.end_lineno])
            for n in nodes]  # with its decorators: @triton.jit
    return HEADER + "\n\n" + "\n\n\n".join(text) + "\n"


def release(source: Source) -> str:
    text = source.read(VERSION) or ""
    v = re.search(r"__version__\s*=\s*version\s*=\s*'([^']+)'", text)
    c = re.search(r"commit_id\s*=\s*'([^']+)'", text)
    return " ".join(x.group(1) for x in (v, c) if x) or "unknown"


def tuned_configs(report: Path) -> dict[str, dict]:
    """vLLM tuned files (name -> {batch key: config}) from the `vllm_config` column of a bench
    report's results.json, as its vLLM baseline ran them."""
    f = report / "results.json"
    try:
        rows = json.loads(f.read_text())["tables"]["results"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Refused(f"--configs-from {report}: no bench results.json there ({e})") from None
    files: dict[str, dict] = {}
    for r in rows:
        try:
            got = tuned_entry(str(r.get("vllm_config") or ""))
        except ValueError as e:
            raise Refused(f"--configs-from {report}: width {r.get('width')}: vllm_config {e.args[0]!r} is not "
                          "KEY=int,...") from None
        if got:
            name, key, cfg = got
            files.setdefault(name, {})[key] = cfg
    if not files:
        raise Refused(f"--configs-from {report}: no row ran vLLM from a tuned file or bench's sweep (vllm_config)")
    return files


def extract(path: Path, out: Path, reports: list[Path] = ()) -> Path:
    source = Source(path)
    files = {"fused_moe.py": jit_closure(source.read(MOE) or "", ["fused_moe_kernel"], f"{path}: {MOE}")}
    quant = source.read(QUANT)
    if quant and "def _per_token_group_quant_fp8(" in quant:
        files["fp8_quant.py"] = jit_closure(quant, ["_per_token_group_quant_fp8"], f"{path}: {QUANT}")
    configs = [n for n in source.names() if n.startswith(CONFIGS) and n.endswith(".json")]
    files |= {f"configs/{Path(n).name}": source.read(n) for n in configs}
    for report in reports:
        for name, cfgs in tuned_configs(report).items():
            files[f"configs/{name}"] = json.dumps(dict(sorted(cfgs.items(), key=lambda kv: int(kv[0]))), indent=1) + "\n"
    version = release(source)
    files["SOURCE.txt"] = f"source: {path.name}\nrelease: {version}\n"
    for name, text in files.items():  # only once every file was read
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    taken = f", tuned by {len(reports)} report(s)" if reports else ""
    print(f"{out}: {', '.join(n for n in files if n.endswith('.py'))}, {len(configs)} configs{taken}, "
          f"vLLM {version}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", type=Path, help="a vLLM wheel (.whl) or a vLLM source tree")
    p.add_argument("--configs-from", type=Path, action="append", default=[], metavar="REPORT",
                   help="a bench report whose vLLM launch configs to write as vLLM's tuned files")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "third_party" / "vllm")
    a = p.parse_args(argv)
    try:
        if not a.source.exists():
            raise Refused(f"{a.source} does not exist; give a vLLM wheel or source tree")
        extract(a.source, a.out, a.configs_from)
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
