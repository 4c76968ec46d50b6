"""python -m zeroalloc doctor | summary [device] | report prefix.json

doctor: checks the set-up (driver, runtime, GPUs, pinned memory, io_uring, NUMA, NCCL,
PyTorch, every ZEROALLOC_* variable) and prints what to do; exits non-zero on a failure.
summary: prints the memory summary of a fresh process's library (shows that it loads and
which device it drives).
report: prints a report's summary and rebuilds its page from the JSON."""

import sys

import zeroalloc


def main(argv: list[str]) -> int:
    if argv[:1] == ["report"]:
        from zeroalloc import report

        return report.main(argv[1:])
    if argv[:1] == ["doctor"]:
        from zeroalloc import doctor

        return doctor.main()
    if len(argv) >= 1 and argv[0] == "summary":
        device = int(argv[1]) if len(argv) > 1 else 0
        print(zeroalloc.memory_summary(device))
        return 0
    print("usage: python -m zeroalloc doctor | summary [device] | report prefix.json",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
