"""The settings reference: one Markdown page generated from the library's options table, so
that the documentation cannot drift from what the library reads.

    python -m zeroalloc settings > docs/settings.md
"""

from __future__ import annotations

from zeroalloc._library import library, read_json

HEADER = """# Settings

zeroalloc reads these environment variables once, when it is first used.
A bad value stops it with a message that names the variable, the value and what it accepts.
So does a `ZEROALLOC_` variable it does not know: a misspelt name is never silently ignored.
`python -m zeroalloc doctor` checks every variable set.

This page is generated from the library's options table (`lib/core/options.cpp`) by
`python -m zeroalloc settings`.

| Variable | Default | Accepts | What it does |
|---|---|---|---|
"""


def cell(text: str) -> str:
    """Text for a table cell: no pipe or line break may end the cell early."""
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """The page: one row per variable, in the table's order."""
    options = read_json(library().zeroalloc_options_json)["options"]
    rows = []
    for option in options:
        default = option.get("default") or ""
        shown_default = f"`{default}`" if default else "unset"
        accepted = option.get("accepted") or ""
        words = accepted.split("|")
        # A choice lists its words; other kinds describe their form in a phrase.
        shown_accepted = (", ".join(f"`{word}`" for word in words)
                          if accepted and not any(" " in word for word in words) else accepted)
        rows.append(f"| `{option['name']}` | {shown_default} | {cell(shown_accepted)} | "
                    f"{cell(option.get('help') or '')} |")
    return HEADER + "\n".join(rows) + "\n"


def main() -> int:
    print(markdown(), end="")
    return 0
