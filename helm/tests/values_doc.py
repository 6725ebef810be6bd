"""The chart's values reference (docs/reference/helm-values.md), generated from helm/kvgate/values.yaml: every key
with its default and the `# --` comment above it. check_chart.py fails when the committed page differs; with
KVGATE_BLESS=1 it writes it.

    python helm/tests/values_doc.py   # prints the page
"""

import re
from pathlib import Path

VALUES = Path(__file__).resolve().parent.parent / "kvgate" / "values.yaml"
PAGE = Path(__file__).resolve().parent.parent.parent / "docs" / "reference" / "helm-values.md"
KEY = re.compile(r"^(\s*)([A-Za-z0-9_]+):\s*(.*)$")


def rows(text: str) -> list[tuple[str, str, str]]:
    """(key path, default, description) for each key of the values file, in file order."""
    out, stack, doc, in_doc = [], [], [], False
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("# --"):
            doc, in_doc = [s[4:].strip()], True
            continue
        if s.startswith("#"):
            if in_doc:
                doc.append(s[1:].strip())
            continue
        if not s:
            doc, in_doc = [], False
            continue
        m = KEY.match(line)
        if not m:  # a list item or a continuation of a flow value
            continue
        indent, key, value = len(m.group(1)), m.group(2), m.group(3).strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [key])
        if value == "":
            stack.append((indent, key))
            if doc:
                out.append((path, "", " ".join(doc)))
        else:
            out.append((path, value, " ".join(doc)))
        doc, in_doc = [], False
    return out


def page() -> str:
    lines = [
        "# Helm chart values",
        "",
        "<!-- Generated from helm/kvgate/values.yaml by helm/tests/values_doc.py; do not edit. -->",
        "",
        "A setting that is `null` is not passed to the binaries: their own default applies (each written once, in",
        "the code: [gateway](gateway.md), [worker](worker.md)).",
        "",
        "| Key | Default | Meaning |",
        "| --- | --- | --- |",
    ]
    for path, default, doc in rows(VALUES.read_text()):
        cell = f"`{default}`" if default else ""
        lines.append(f"| `{path}` | {cell.replace('|', '&#124;')} | {doc.replace('|', '&#124;')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(page(), end="")
