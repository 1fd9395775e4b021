"""The planner's three-block profile against the whole trace's, for every model family users bring.

    python benchmarks/profile_families.py              # every family of tests/distributed/users_models.py
    python benchmarks/profile_families.py llama cohere # some of them

Each family is built with six layers (three more than the profile traces) and profiled twice: as
``usc.plan`` does (a stack of equal blocks traced on three of them, the steady one stamped) and from
a trace of every layer. They must be equal; the line also says whether the stack was stamped or the
checks sent it to the whole trace, and the CPU seconds of each.
"""

import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "distributed"))

import users_models  # noqa: E402

from usc.compiler.trace import trace  # noqa: E402
from usc.model_call import trainable  # noqa: E402
from usc.passes import cost_profile  # noqa: E402


def main(names: list[str]) -> int:
    warnings.filterwarnings("ignore")
    users_models.LAYERS = 6
    cut, stamped = [], []  # a stack cut to three blocks (its blocks compared); a profile stamped
    repeats, stamp = cost_profile._blocks_repeat, cost_profile._stamp

    def compared(traced, path):
        cut.append(path)
        return repeats(traced, path)

    def stamping(profile, stacks):
        stamped.append(stamp(profile, stacks))
        return stamped[-1]

    cost_profile._blocks_repeat, cost_profile._stamp = compared, stamping
    unequal = 0
    for name in names or list(users_models.FAMILIES):
        family = users_models.FAMILIES[name]
        try:
            torch.manual_seed(0)
            model = trainable(family.build(), family.loss_fn)
            batch = model.flatten(family.batch(0, 6))
            cut.clear()
            stamped.clear()
            start = time.process_time()
            fast = cost_profile.profile_model(model, batch)
            fast_s, start = time.process_time() - start, time.process_time()
            whole = cost_profile.profile_model(model, batch, traced=trace(model, batch))
            whole_s = time.process_time() - start
        except Exception as exc:  # noqa: BLE001 - a family that does not profile is reported, not fatal
            print(f"{name:18s} does not profile: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            continue
        how = "no stack cut" if not cut else "stamped" if any(stamped) else "checks: traced whole"
        unequal += fast != whole
        print(f"{name:18s} {'equal' if fast == whole else 'NOT EQUAL'}  {how:22s} "
              f"profile {fast_s:.2f} s, whole trace {whole_s:.2f} s CPU", flush=True)
    return 1 if unequal else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
