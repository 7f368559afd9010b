"""Score of a mutmut run (tools/mutation.sh): killed / checked per module and overall, and the survivors.

Reads ``mutmut results --all true`` (lines ``<module>.x_<function>__mutmut_<n>: <status>``). A mutant counts as
killed when the tests failed on it (killed) or ran into the timeout (timeout: the mutant made a test hang); it
survives when the tests passed (survived) or no selected test reached it (no tests). Mutants outside the run's
scope (``not checked``) are left out. Mutants judged equivalent (tools/mutation_equivalent.txt: one name per
line, ``# reason`` after it) are listed apart and left out of the score.

Usage: python tools/mutation_score.py RESULTS [--functions]   (--functions: one row per function, not per module)
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

KILLED = {"killed", "timeout", "segfault", "caught by type check"}
SURVIVED = {"survived", "no tests", "suspicious"}


def main(path: str, by_function: bool = False) -> int:
    equivalent = {}
    eq_file = Path(__file__).with_name("mutation_equivalent.txt")
    if eq_file.exists():
        for line in eq_file.read_text().splitlines():
            name, _, reason = line.partition("#")
            if name.strip():
                equivalent[name.strip()] = reason.strip()
    per: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for line in Path(path).read_text().splitlines():
        m = re.match(r"\s*(\S+__mutmut_\d+): (.+)$", line)
        if not m or m.group(2).strip() == "not checked":
            continue
        name, status = m.group(1), m.group(2).strip()
        module = re.split(r"\.x[_ǁ]", name, maxsplit=1)[0].removeprefix("pytest_packcheck.")
        if by_function:  # module.function: the area a row of the table scores
            module += "." + re.split(r"\.x[_ǁ]", name, maxsplit=1)[1].split("__mutmut_")[0].lstrip("_")
        kind = "equivalent" if name in equivalent else "killed" if status in KILLED else "survived" if status in SURVIVED else status
        per[module][kind].append(name)
    total_k = total_n = 0
    w = max([12, *(len(m) for m in per)])
    print(f"{'module':<{w}} {'mutants':>7} {'killed':>6} {'survived':>8} {'equivalent':>10} {'score':>6}")
    for module, kinds in sorted(per.items()):
        k, s, e = len(kinds["killed"]), len(kinds["survived"]), len(kinds["equivalent"])
        other = sum(len(v) for key, v in kinds.items() if key not in ("killed", "survived", "equivalent"))
        n = k + s + other
        total_k, total_n = total_k + k, total_n + n
        print(f"{module:<{w}} {n + e:>7} {k:>6} {s + other:>8} {e:>10} {100 * k / max(n, 1):>5.1f}%")
    print(f"{'overall':<{w}} {total_n + sum(len(k['equivalent']) for k in per.values()):>7} {total_k:>6} "
          f"{total_n - total_k:>8} {sum(len(k['equivalent']) for k in per.values()):>10} {100 * total_k / max(total_n, 1):>5.1f}%")
    for module, kinds in sorted(per.items()):
        for kind in sorted(k for k in kinds if k != "killed"):
            for name in kinds[kind]:
                print(f"{kind}: {name}" + (f"  # {equivalent[name]}" if name in equivalent else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], "--functions" in sys.argv[2:]))
