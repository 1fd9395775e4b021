"""The op-coverage figure of the README: every aten op in the traces of the "models users bring"
tier (tests/distributed/users_models.py, each family traced as users call it, mixture-of-experts
layers as plain ops) and the link of the rule chain that places it.

    python benchmarks/op_coverage.py
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "distributed"))

from users_models import FAMILIES, traced_ops  # noqa: E402

from usc.passes.derived_rules import rule_link  # noqa: E402


def ops_by_link(families=FAMILIES) -> dict[str, set[str]]:
    found: dict[str, set[str]] = defaultdict(set)
    for family in families:
        for op in traced_ops(family):
            found[rule_link(op)].add(str(op))
    return found


def main() -> None:
    found = ops_by_link()
    total = sum(len(ops) for ops in found.values())
    print(f"{len(FAMILIES)} models, {total} distinct aten ops in their traces")
    for link, ops in sorted(found.items(), key=lambda item: -len(item[1])):
        print(f"  {link:<17} {len(ops):>3}  {', '.join(sorted(ops)) if link != 'hand rule' else ''}")


if __name__ == "__main__":
    main()
