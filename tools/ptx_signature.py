"""A fingerprint of each Triton build's sm_90 PTX, to prove a source change left the compiled code
as it was: python3 scripts/ptx_signature.py TP W1,W2,... [--final] (offline, no GPU; the
FFNQ_TRITON_TUNE in the environment applies). Prints "TP WIDTH FINAL MD5" per build.

The PTX is hashed without its debug sections, .loc/.file lines and comments, with registers and
labels renumbered in order of appearance and labels no branch names dropped (a helper that moves
wraps the same code in labels of its own), so two sources that compile to the same instructions
print the same hash. Run it on both trees with separate TRITON_CACHE_DIRs and diff the output.
"""
import argparse
import hashlib
import re
from concurrent.futures import ProcessPoolExecutor


def normalize(ptx: str) -> str:
    p = ptx.split("\t.section\t.debug")[0]
    p = "\n".join(ln for ln in p.splitlines() if not ln.strip().startswith((".loc", ".file", "//")))
    regs: dict[str, str] = {}
    p = re.sub(r"%[a-z]+\d+", lambda m: regs.setdefault(m.group(0), f"%N{len(regs)}"), p)
    labels: dict[str, str] = {}
    p = re.sub(r"\$L__\w+", lambda m: labels.setdefault(m.group(0), f"L{len(labels)}"), p)
    is_label = re.compile(r"^L\d+:$")
    used = set(re.findall(r"\bL\d+\b", "\n".join(ln for ln in p.splitlines() if not is_label.match(ln))))
    p = "\n".join(ln for ln in p.splitlines() if not (is_label.match(ln) and ln[:-1] not in used))
    again: dict[str, str] = {}
    return re.sub(r"\bL\d+\b", lambda m: again.setdefault(m.group(0), f"M{len(again)}"), p)


def signature(args: tuple[int, int, bool]) -> tuple[int, int, bool, str]:
    from ffnq.backends.triton import offline
    from ffnq.spec import Experts, load_model

    tp, width, final = args
    key = offline.build_key(load_model("minimax-m2"), tp, Experts.ALL, width)
    ptx = offline.compile_key(key, "sm_90", final=final).asm["ptx"]
    return tp, width, final, hashlib.md5(normalize(ptx).encode()).hexdigest()[:10]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tp", type=int)
    ap.add_argument("widths", help="comma-separated widths, e.g. 1,3,4,16")
    ap.add_argument("--final", action="store_true", help="also the final=True build of each width")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    finals = (False, True) if a.final else (False,)
    builds = [(a.tp, int(w), f) for w in a.widths.split(",") for f in finals]
    with ProcessPoolExecutor(a.jobs) as ex:
        for tp, w, f, h in ex.map(signature, builds):
            print(tp, w, int(f), h)


if __name__ == "__main__":
    main()
