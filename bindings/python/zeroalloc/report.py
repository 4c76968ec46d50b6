"""python -m zeroalloc report prefix.json: prints a report's summary and rebuilds its page
(prefix.html) from the JSON, with the same template the library writes it with."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from zeroalloc._library import ZeroallocError, last_error, library
from zeroalloc._stats import _format_bytes


def _peak(gauge: dict) -> int:
    """The peak over the whole run (the program may have reset its peak statistics)."""
    return gauge.get("lifetime_peak", gauge["peak"])


def summary(report: dict) -> str:
    lines = [f"zeroalloc report written {report['time']} because of: {report['reason']} "
             f"(process {report['pid']}, zeroalloc {report['version']})"]
    for device in report["devices"]:
        stats = device["stats"]
        total = stats["total"]
        peak_allocated = _peak(total["allocated_bytes"])
        peak_reserved = _peak(total["reserved_bytes"])
        ratio = f"{peak_reserved / peak_allocated:.3f}" if peak_allocated else "-"
        lines.append(f"device {device['device']} ({stats['device_name']}): peak allocated "
                     f"{_format_bytes(peak_allocated)}, peak reserved "
                     f"{_format_bytes(peak_reserved)} (ratio {ratio}), limit "
                     f"{_format_bytes(stats['limit_bytes'])}; {total['allocations']} "
                     f"allocations, {total['retries']} retries, {total['failures']} failures")
        for name, figures in stats["classes"].items():
            if figures["allocations"]:
                lines.append(f"  {name:<16} peak allocated "
                             f"{_format_bytes(_peak(figures['allocated_bytes'])):>12}, "
                             f"peak reserved {_format_bytes(_peak(figures['reserved_bytes'])):>12}")
        offload = device.get("offload")
        if offload:
            lines.append(f"  offload: {_format_bytes(offload['bytes_to_host'])} to the host, "
                         f"{_format_bytes(offload['bytes_to_device'])} back; "
                         f"{_format_bytes(offload['host_resident_bytes'])} on the host now "
                         f"(host limit {_format_bytes(offload['host_limit_bytes'])}); prefetch "
                         f"hit rate {offload['prefetch_hit_rate']:.1%}; device waited "
                         f"{offload['device_waited_ns'] / 1e6:.1f} ms for fetches")
        for allocation in device["largest_allocations"][:5]:
            lines.append(f"  live: {_format_bytes(allocation['size'])} ({allocation['class']}) "
                         f"at {allocation['address']:#x}")
    samples = len(report["timeline"]["t_ms"])
    lines.append(f"timeline: {samples} samples")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m zeroalloc report prefix.json", file=sys.stderr)
        return 2
    json_path = Path(argv[0])
    try:
        report = json.loads(json_path.read_text())
    except (OSError, ValueError) as failure:
        print(f"cannot read the report {json_path}: {failure}", file=sys.stderr)
        return 1
    try:
        print(summary(report))
    except (KeyError, TypeError, AttributeError) as failure:
        print(f"{json_path} is JSON, but not a zeroalloc report (no {failure} where a report "
              "has one): pass the prefix.json that ZEROALLOC_REPORT wrote", file=sys.stderr)
        return 1
    html_path = json_path.with_suffix(".html")
    try:
        if library().zeroalloc_report_render(str(json_path).encode(),
                                             str(html_path).encode()) != 0:
            raise ZeroallocError(last_error())
    except (ZeroallocError, OSError) as failure:
        print(f"the page was not rebuilt: {failure}", file=sys.stderr)
        return 1
    print(f"page: {html_path}")
    return 0
