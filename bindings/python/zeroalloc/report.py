"""python -m zeroalloc report prefix.json: prints a report's summary and rebuilds its page
(prefix.html) from the JSON, with the same template the library writes it with
(report_template.html, this package's data file, which the build compiles into the
library). Loads no native library: a report can be read where zeroalloc never ran."""

from __future__ import annotations

import json
import os
import sys
from importlib import resources
from pathlib import Path

from zeroalloc._stats import _format_bytes

# Where the template takes the report's JSON (as in lib/profile/report.cpp).
_JSON_MARKER = "/*ZEROALLOC_REPORT_JSON*/"


def _peak(gauge: dict) -> int:
    """The peak over the whole run (the program may have reset its peak statistics)."""
    return gauge.get("lifetime_peak", gauge["peak"])


def held_under_limit(series: dict, times_ms: list) -> dict:
    """Note [Held under the limit] (lib/profile/report.cpp): the most the device held under
    the last limit and before it took effect (`since_ms`, None when it never changed), and
    the most the host held."""
    device, limits = series.get("device") or [], series.get("limit") or []
    since = len(limits)
    while since > 0 and limits[since - 1] == limits[-1]:
        since -= 1
    return {"device": max(device[since:], default=0),
            "device_before": max(device[:since], default=0),
            "host": max(series.get("host") or [0]),
            "since_ms": times_ms[since] if 0 < since < len(times_ms) else None}


def summary(report: dict) -> str:
    lines = [f"zeroalloc report written {report['time']} because of: {report['reason']} "
             f"(process {report['pid']}, zeroalloc {report['version']})"]
    for device in report["devices"]:
        stats = device["stats"]
        total = stats["total"]
        peak_allocated = _peak(total["allocated_bytes"])
        peak_reserved = _peak(total["reserved_bytes"])
        ratio = f"{peak_reserved / peak_allocated:.3f}" if peak_allocated else "-"
        # The device first, as the page leads: allocated and reserved bytes are addresses,
        # wherever their bytes are (on the host, with offload).
        series = report["timeline"]["devices"].get(str(device["device"]), {})
        held = held_under_limit(series, report["timeline"].get("t_ms", []))
        device_held = held["device"] if series.get("device") else peak_reserved
        limit = _format_bytes(stats["limit_bytes"])
        device_text = _format_bytes(device_held)
        if held["since_ms"] is not None:  # Note [Held under the limit] (lib/profile/report.cpp)
            limit += f" from {held['since_ms'] / 1000:.1f} s"
            device_text += f" under it ({_format_bytes(held['device_before'])} before)"
        lines.append(f"device {device['device']} ({stats['device_name']}): limit {limit}; "
                     f"the device held at most {device_text}, the host at most "
                     f"{_format_bytes(held['host'])}")
        lines.append(f"  virtual, wherever the bytes are: peak allocated "
                     f"{_format_bytes(peak_allocated)}, peak reserved "
                     f"{_format_bytes(peak_reserved)} (ratio {ratio}); {total['allocations']} "
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
            if offload.get("disk_capacity_bytes"):
                lines.append(f"  disk tier: {_format_bytes(offload['disk_resident_bytes'])} on "
                             f"disk now of {_format_bytes(offload['disk_capacity_bytes'])}; "
                             f"{_format_bytes(offload['bytes_to_disk'])} written, "
                             f"{_format_bytes(offload['bytes_from_disk'])} read, in "
                             f"{offload['disk_ns'] / 1e6:.1f} ms of transfers")
        for allocation in device["largest_allocations"][:5]:
            lines.append(f"  live: {_format_bytes(allocation['size'])} ({allocation['class']}) "
                         f"at {allocation['address']:#x}")
    for name, fields in report.get("sections", {}).items():  # zeroalloc_report_section
        shown = ", ".join(f"{key} {_format_bytes(value) if key.endswith('bytes') else value}"
                          for key, value in fields.items())
        lines.append(f"{name}: {shown}")
    samples = len(report["timeline"]["t_ms"])
    lines.append(f"timeline: {samples} samples")
    ended = [step for step in report.get("steps", []) if step["ended"]]  # none in older reports
    if ended:
        lines.append(f"steps: {ended[-1]['last_step']} ended, the last at "
                     f"{ended[-1]['end_ms'] / 1000:.2f} s (the page has a table per step)")
    return "\n".join(lines)


def render_html(report_json: str) -> str:
    """The page of a report: the template with the report's JSON text inlined, byte for byte
    the page the library writes for the same JSON."""
    template = resources.files("zeroalloc").joinpath("report_template.html").read_text(
        encoding="utf-8")
    # Inlined in a script element: "</" must not close it early.
    return template.replace(_JSON_MARKER, report_json.replace("</", "<\\/"), 1)


def write_page(json_text: str, html_path: Path) -> None:
    """Writes the page through a temporary file and a rename, as the library does: a reader
    never sees half a page, and a failed write leaves the previous one."""
    temporary = html_path.with_name(f"{html_path.name}.tmp.{os.getpid()}")
    try:
        temporary.write_text(render_html(json_text), encoding="utf-8", errors="surrogateescape")
        temporary.replace(html_path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m zeroalloc report prefix.json", file=sys.stderr)
        return 2
    json_path = Path(argv[0])
    try:
        # As bytes: the page inlines the JSON exactly as the library wrote it.
        json_text = json_path.read_bytes().decode("utf-8", errors="surrogateescape")
        report = json.loads(json_text)
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
        write_page(json_text, html_path)
    except OSError as failure:
        print(f"the page was not rebuilt: {failure}", file=sys.stderr)
        return 1
    print(f"page: {html_path}")
    return 0
