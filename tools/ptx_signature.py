"""A fingerprint of each Triton build's compiled code, to prove a source change left it as it was:
python3 tools/ptx_signature.py TP W1,W2,... [--final] [--target sm_90|gfx942|gfx950] (offline, no
GPU; the FFNQ_TRITON_TUNE in the environment applies). Prints "TP WIDTH FINAL MD5" per build.

sm_90 hashes the PTX, gfx942/gfx950 the AMDGCN assembly. Either is hashed without its debug
sections, .loc/.file lines and comments, with registers (PTX) and labels renumbered in order of
appearance and labels no branch names dropped (a helper that moves wraps the same code in labels
of its own), so two sources that compile to the same instructions print the same hash. Run it on
both trees with separate TRITON_CACHE_DIRs and diff the output.
"""
import argparse
import hashlib
import re
from concurrent.futures import ProcessPoolExecutor

TARGETS = ("sm_90", "gfx942", "gfx950")


def _drop_unused_labels(p: str, label: str) -> str:
    """Renumber the labels matched by ``label`` in order of appearance, drop those no line
    names, and renumber the rest again."""
    labels: dict[str, str] = {}
    p = re.sub(label, lambda m: labels.setdefault(m.group(0), f"L{len(labels)}"), p)
    is_label = re.compile(r"^L\d+:$")
    used = set(re.findall(r"\bL\d+\b", "\n".join(ln for ln in p.splitlines() if not is_label.match(ln))))
    p = "\n".join(ln for ln in p.splitlines() if not (is_label.match(ln) and ln[:-1] not in used))
    again: dict[str, str] = {}
    return re.sub(r"\bL\d+\b", lambda m: again.setdefault(m.group(0), f"M{len(again)}"), p)


def normalize(ptx: str) -> str:
    p = ptx.split("\t.section\t.debug")[0]
    p = "\n".join(ln for ln in p.splitlines() if not ln.strip().startswith((".loc", ".file", "//")))
    regs: dict[str, str] = {}
    p = re.sub(r"%[a-z]+\d+", lambda m: regs.setdefault(m.group(0), f"%N{len(regs)}"), p)
    return _drop_unused_labels(p, r"\$L__\w+")


def normalize_amdgcn(asm: str) -> str:
    """The AMDGCN text without comments (';' to the end of a line), .loc/.file/.cfi lines and
    the .debug_* sections, its local labels (.LBB, .Ltmp, .Lfunc_end ...) renumbered."""
    out, skip = [], False
    for ln in asm.splitlines():
        s = ln.split(";", 1)[0].rstrip()
        st = s.strip()
        if st.startswith(".section"):
            skip = ".debug" in st
        if skip or not st or st.startswith((".loc", ".file", ".cfi_", "//")):
            continue
        out.append(st)
    return _drop_unused_labels("\n".join(out), r"\.L\w+")


def signature(args: tuple[int, int, bool, str]) -> tuple[int, int, bool, str]:
    from ffnq.backends.triton import offline
    from ffnq.spec import Experts, load_model

    tp, width, final, target = args
    key = offline.build_key(load_model("minimax-m2"), tp, Experts.ALL, width, target=target)
    ck = offline.compile_key(key, target, final=final)
    text = normalize(ck.asm["ptx"]) if target == "sm_90" else normalize_amdgcn(ck.asm["amdgcn"])
    return tp, width, final, hashlib.md5(text.encode()).hexdigest()[:10]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tp", type=int)
    ap.add_argument("widths", help="comma-separated widths, e.g. 1,3,4,16")
    ap.add_argument("--final", action="store_true", help="also the final=True build of each width")
    ap.add_argument("--target", default="sm_90", choices=TARGETS)
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    finals = (False, True) if a.final else (False,)
    builds = [(a.tp, int(w), f, a.target) for w in a.widths.split(",") for f in finals]
    with ProcessPoolExecutor(a.jobs) as ex:
        for tp, w, f, h in ex.map(signature, builds):
            print(tp, w, int(f), h, flush=True)


if __name__ == "__main__":
    main()
