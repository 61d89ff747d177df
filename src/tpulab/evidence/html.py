"""Markdown -> one self-contained HTML page (the subset tpulab's reports use).

Shared by the evidence report, the decision dossier and the cloud experiment log. Images are
embedded as data URIs and the page's Content-Security-Policy loads nothing from elsewhere, so a
page can be mailed or archived as one file.
"""

from __future__ import annotations

import base64
import html
import mimetypes
import re
from pathlib import Path

_CSS = (
    "body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:60rem;"
    "margin:2rem auto;\n"
    "padding:0 1rem;line-height:1.45;color:#1b1b1b}table{border-collapse:collapse;margin:1rem 0}\n"
    "td,th{border:1px solid #ccc;padding:.3rem .6rem;text-align:left;vertical-align:top}"
    "th{background:#f3f3f3}\n"
    "code{background:#f3f3f3;padding:0 .2rem;border-radius:3px}"
    "pre{background:#f6f6f6;padding:.6rem;overflow:auto}\n"
    "img{max-width:100%;height:auto;border:1px solid #ddd}.missing{color:#b00020}"
)


def _data_uri(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _inline(text: str, base: Path) -> str:
    """Escape, then code spans, images (embedded), links, bold.

    Code spans are protected from the rest.
    """
    codes: list[str] = []

    def keep_code(m):
        codes.append(f"<code>{html.escape(m.group(1))}</code>")
        return f"\x00{len(codes) - 1}\x00"

    text = re.sub(r"`([^`]+)`", keep_code, text)
    text = html.escape(text, quote=False)

    def image(m):
        alt, src = m.group(1), html.unescape(m.group(2))
        uri = None if re.match(r"^[a-z]+:", src) else _data_uri(base / src)
        if uri is None:
            return f'<span class="missing">[missing image: {html.escape(src)}]</span>'
        return f'<img alt="{html.escape(alt, quote=True)}" src="{uri}">'

    text = re.sub(r"!\[([^\]]*)\]\(([^)\s]+)\)", image, text)
    text = re.sub(
        r"\[([^\]]+)\]\(([^)\s]+)\)",
        lambda m: (
            f'<a href="{html.escape(html.unescape(m.group(2)), quote=True)}">{m.group(1)}</a>'
        ),
        text,
    )
    text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", text)
    return re.sub("\x00(\\d+)\x00", lambda m: codes[int(m.group(1))], text)


def _cells(row: str) -> list[str]:
    """A table row's cells: split on ``|`` but not on the escaped ``\\|`` a cell may hold."""
    row = row.strip().removeprefix("|")
    row = row[:-1] if row.endswith("|") and not row.endswith("\\|") else row
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", row)]


def render_html(text: str, base: Path, title: str = "tpulab report") -> str:
    """Headings, paragraphs, lists, tables, fenced code, images, links, bold and code spans."""
    out, para, lines, i = [], [], text.splitlines(), 0

    def flush():
        if para:
            out.append(f"<p>{_inline(' '.join(para), base)}</p>")
            para.clear()

    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            flush()
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            out.append(f"<pre>{html.escape(chr(10).join(lines[i + 1 : j]))}</pre>")
            i = j + 1
            continue
        if m := re.match(r"^(#{1,6})\s+(.*)", line):
            flush()
            n = len(m.group(1))
            out.append(f"<h{n}>{_inline(m.group(2), base)}</h{n}>")
        elif (
            line.lstrip().startswith("|")
            and i + 1 < len(lines)
            and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1])
        ):
            flush()
            head = "".join(f"<th>{_inline(c, base)}</th>" for c in _cells(line))
            rows, i = [], i + 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append(
                    "<tr>"
                    + "".join(f"<td>{_inline(c, base)}</td>" for c in _cells(lines[i]))
                    + "</tr>"
                )
                i += 1
            out.append(
                f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
            )
            continue
        elif re.match(r"^\s*[-*]\s+", line):
            flush()
            items = []
            while i < len(lines) and re.match(r"^\s*[-*]\s+", lines[i]):
                item = re.sub(r"^\s*[-*]\s+", "", lines[i])
                items.append(f"<li>{_inline(item, base)}</li>")
                i += 1
            out.append(f"<ul>{''.join(items)}</ul>")
            continue
        elif not line.strip():
            flush()
        else:
            para.append(line.strip())
        i += 1
    flush()
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src data:; '
        "style-src 'unsafe-inline'\">"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(out)
        + "\n</body></html>\n"
    )
