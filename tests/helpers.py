"""Run the real ``ffnq`` console script in a subprocess (what a user types)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def ffnq_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "ffnq"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("ffnq")
    return [found] if found else [sys.executable, "-m", "ffnq.cli"]


def ffnq(*args, env: dict | None = None, timeout: float = 240, cwd: Path | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="200")
    e.update(env or {})
    return subprocess.run([*ffnq_cmd(), *map(str, args)], capture_output=True, text=True, env=e, timeout=timeout,
                          cwd=cwd)


def one_report(out: Path, job: str) -> Path:
    found = [p for p in out.iterdir() if f"-{job}-" in p.name]
    assert len(found) == 1, [p.name for p in out.iterdir()]
    return found[0]


def job_pids(under: Path | str) -> list[int]:
    """The live processes of an ffnq job whose folder is under ``under`` (torchrun and the ranks:
    their command lines name ``python -m ffnq.jobs.<job>`` and the job's options file): this
    test's own job only, not another run's on the same host."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().decode(errors="replace") if d.name.isdigit() else ""
        except OSError:
            continue
        if "ffnq.jobs." in cmd and str(under) in cmd:
            pids.append(int(d.name))
    return pids


def write_checkpoint(where: Path, spec, layers, seed: int = 0, config: dict | None = None, **replace) -> Path:
    """A MiniMax-M2-style checkpoint of ``spec`` holding decoder ``layers`` (layer L synthetic from
    seed + L) in two files, with a config.json (``config`` over the model's own keys); ``replace``
    maps a tensor name to the tensor written in its place (or beside the others)."""
    from safetensors.torch import load_file, save_file

    from ffnq.weights import save_checkpoint, synthetic

    save_checkpoint(where, {layer: synthetic(spec, seed + layer) for layer in layers}, spec, config=config)
    if replace:  # each name in one file only: the first, beside or in place of the original
        for i, f in enumerate(sorted(where.glob("*.safetensors"))):
            kept = {n: t for n, t in load_file(f).items() if n not in replace}
            save_file(kept | (replace if i == 0 else {}), f)
    return where
