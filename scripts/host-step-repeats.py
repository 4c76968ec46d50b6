"""Runs tests/python/test_host_step.py's MASTERS script many times in each of some settings,
and prints, per run, its losses' worst relative difference from the plain recipe and the
first step where it differs from the setting's first run. A setting whose runs differ from
each other is not deterministic: a race, not rounding.

    python3 scripts/host-step-repeats.py 6 'ZEROALLOC_ACCESS=hinted' \
        'ZEROALLOC_ACCESS=hinted ZEROALLOC_HOST_STEP_OVERLAP=0' 'ZEROALLOC_ACCESS=any GUARD=1'

Under hinted the CPUs run behind the forward unless ZEROALLOC_HOST_STEP_OVERLAP=0 (Note
[Behind the forward under hinted] in zeroalloc/torch/_host_step.py).
"""

import concurrent.futures
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))

import test_host_step as hs  # noqa: E402
from gpu_script import field, run_script  # noqa: E402

# Probes, set in a setting's variables, to tell a race's cause in one call. UNHELD=1: the
# step boundary as it was before Note [A use the boundary waits for]. SYNCW=1: the CPUs'
# thread waits for each window's copies into the working copies before it goes on.
# CHECKW=1: when a run is finished (finish_behind), each working copy the CPUs wrote is
# compared with the bytes they wrote (lost writes). CHECKF=1: each hinted use on the main
# thread sums its working copies in stream order, and the sums are taken again when the run
# is finished (a use that read other bytes than those that stayed). The script prints
# "checked" with, per finished run, written:lost/read:stale.
PROBES = r"""
if os.environ.get("UNHELD"):
    from zeroalloc import _offload as unheld
    unheld.step_boundary = lambda: unheld.library().zeroalloc_step_boundary()
if os.environ.get("SYNCW"):
    from zeroalloc.torch import _host_step as probed

    def synchronized(self, *arguments, write_working=probed.HostStep.write_working):
        write_working(self, *arguments)
        self.stream.synchronize()
    probed.HostStep.write_working = synchronized
if os.environ.get("CHECKW") or os.environ.get("CHECKF"):
    import atexit, threading
    from zeroalloc import _offload as checked_offload
    from zeroalloc.torch import _host_step as checked
    expected, reads, found, comparing = {}, [], [], []

    def recorded(self, stepper, members, outputs, *rest,
                 write_working=checked.HostStep.write_working):
        write_working(self, stepper, members, outputs, *rest)
        if os.environ.get("CHECKW"):
            for (parameter, _), output in zip(members, outputs):
                working = checked.working_of(stepper, parameter)
                expected[id(working)] = (working, output.detach().reshape(-1).clone())
    checked.HostStep.write_working = recorded

    def begins(pointers, stream=0, use_begins_many=checked_offload.use_begins_many):
        use_begins_many(pointers, stream)
        if (not os.environ.get("CHECKF") or comparing
                or threading.current_thread() is not threading.main_thread()):
            return
        if globals().get("model") is None:
            return
        by_pointer = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
        on = checked.stream_of(stream, torch.cuda.current_device())
        with torch.no_grad(), torch.cuda.stream(on):
            for pointer in pointers:
                if pointer in by_pointer:
                    p = by_pointer[pointer]
                    reads.append((p, torch.sum(p.detach(), dtype=torch.float32)))
    checked_offload.use_begins_many = begins

    def compared(self, finish_behind=checked.HostStep.finish_behind):
        finish_behind(self)
        if not expected and not reads:
            return
        comparing.append(True)
        try:
            torch.cuda.synchronize()
            lost = stale = 0
            with torch.no_grad():
                for working, want in expected.values():
                    with zt.using(working):
                        got = working.detach().reshape(-1).to("cpu")
                    lost += not torch.equal(got, want)
                for p, before in reads:
                    with zt.using(p):
                        now = torch.sum(p.detach(), dtype=torch.float32)
                    stale += not torch.equal(now, before)
            found.append(f"{len(expected)}:{lost}/{len(reads)}:{stale}")
            expected.clear()
            reads.clear()
        finally:
            comparing.clear()
    checked.HostStep.finish_behind = compared
    atexit.register(lambda: print("checked", " ".join(found), flush=True))
"""
SCRIPT = hs.MASTERS.replace("zt.install()\n", "zt.install()\n" + PROBES, 1)
assert SCRIPT != hs.MASTERS


def losses(out: str) -> list:
    return [float(v) for v in field(out, "losses").split()]


def main() -> None:
    repeats = int(sys.argv[1])
    settings = [dict(part.split("=", 1) for part in each.split()) for each in sys.argv[2:]]
    work = Path(tempfile.mkdtemp())
    plain = losses(run_script(hs.MASTERS, str(work / "plain.pt"), RECIPE="plain"))
    jobs = [(n, r) for n in range(len(settings)) for r in range(repeats)]

    def one(job):
        n, r = job
        try:
            out = run_script(SCRIPT, str(work / f"{n}-{r}.pt"), **{**hs.HOSTED, **settings[n]})
            checked = [line for line in out.splitlines() if line.startswith("checked ")]
            refused = re.search(r"'host_refused': (\d+)", out)
            behind = re.search(r"'host_behind_steps': (\d+)", out)
            print(f"{sys.argv[2 + n]}, run {r}: refused {refused and refused[1]}, behind "
                  f"{behind and behind[1]}; {checked[0] if checked else ''}", flush=True)
            return job, losses(out)
        except AssertionError as failed:  # a run that failed (ZEROALLOC_VERIFY stops one)
            print(f"{sys.argv[2 + n]}, run {r} failed:", str(failed)[-1500:], flush=True)
            return job, None

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        found = dict(pool.map(one, jobs))
    for n, setting in enumerate(settings):
        runs = [found[(n, r)] for r in range(repeats) if found[(n, r)] is not None]
        if not runs:
            print(f"{sys.argv[2 + n]}: every run failed", flush=True)
            continue
        worst = [max(abs(a - b) / abs(a) for a, b in zip(plain, got)) for got in runs]
        apart = [next((i for i, (a, b) in enumerate(zip(runs[0], got)) if a != b), "-")
                 for got in runs]
        print(f"{' '.join(sys.argv[2 + n].split()) or 'base'}: worst vs plain "
              f"{' '.join(f'{w:.1e}' for w in worst)}; first step apart from run 0: "
              f"{' '.join(str(a) for a in apart)}", flush=True)


if __name__ == "__main__":
    main()
