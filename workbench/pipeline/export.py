"""From an executed notebook to the files a reader opens: HTML (with and without inputs, each opening with the
experiment's summary when given one), PNG figures and the CSV tables the notebook saved.

nbconvert is imported lazily, inside the functions, so importing this module costs nothing.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from workbench.atomic import atomic_write_bytes, atomic_write_text
from workbench.record import FIGURE_METADATA_KEY, FIGURES_DIR, TABLES_DIR

NOINPUT_SUFFIX = ".noinput.html"
# cells papermill adds to an executed notebook: the injected parameters, and the error banner of a failed run
PAPERMILL_INSERTED_TAGS = ("injected-parameters", "papermill-error-cell-tag")


def is_papermill_cell(cell: Any) -> bool:
    """Whether papermill inserted ``cell`` (it is not in the source notebook)."""
    tags = cell.get("metadata", {}).get("tags", [])
    return any(tag in tags for tag in PAPERMILL_INSERTED_TAGS)


def source_cell_index(nb: Any, papermill_index: int) -> int:
    """Index in the source notebook of the cell papermill reports as ``papermill_index`` for the executed
    notebook ``nb``. papermill counts cells without its error banners but with its injected parameters."""
    cells = [c for c in nb.cells if "papermill-error-cell-tag" not in c.get("metadata", {}).get("tags", [])]
    return papermill_index - sum(1 for cell in cells[:papermill_index] if is_papermill_cell(cell))


def export_html(
    nb: Any, path: str | Path, *, hide_input: bool = False, title: str | None = None, summary_html: str | None = None
) -> Path:
    """Write ``nb`` (a NotebookNode) as one self-contained HTML file: outputs' images are inline base64,
    markdown images are embedded, the stylesheet is inline. ``hide_input=True`` drops code cells' inputs
    and prompts (a reader's version). ``summary_html`` (``index.render_notebook_summary``) opens the page, before
    the notebook's first cell (inserted into the exported page as it is: nbconvert would sanitise it as a cell)."""
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab")
    exporter.embed_images = True
    if hide_input:
        exporter.exclude_input = True
        exporter.exclude_input_prompt = True
        exporter.exclude_output_prompt = True
    resources = {"metadata": {"name": title}} if title else None
    body, _ = exporter.from_notebook_node(nb, resources=resources)
    if summary_html:
        body = insert_at_top(body, summary_html)
    return atomic_write_text(path, body)


def insert_at_top(page: str, fragment: str) -> str:
    """``page`` with ``fragment`` right after its opening ``<main>`` tag (the lab template's notebook), else after
    its ``<body>`` tag, else at its start."""
    for tag in ("<main", "<body"):
        start = page.find(tag)
        if start >= 0:
            end = page.index(">", start) + 1
            return page[:end] + "\n" + fragment + "\n" + page[end:]
    return fragment + page


def extract_figures(nb: Any, out_dir: str | Path) -> list[Path]:
    """Write each inline PNG output of ``nb`` to ``<out_dir>/figures/cell<NN>-<k>.png``, where NN is the
    cell's index in the source notebook and k counts that cell's images from 1.

    Images shown by ``workbench.record.figure`` carry a metadata mark and are skipped: that helper already
    saved them under their own names in the same folder. Returns the files written, in notebook order.
    """
    folder = Path(out_dir) / FIGURES_DIR
    written: list[Path] = []
    index = -1
    for cell in nb.cells:
        if is_papermill_cell(cell):
            continue
        index += 1
        if cell.get("cell_type") != "code":
            continue
        k = 0
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            png = data.get("image/png")
            if not png or FIGURE_METADATA_KEY in output.get("metadata", {}):
                continue
            k += 1
            text = png if isinstance(png, str) else "".join(png)
            written.append(atomic_write_bytes(folder / f"cell{index:02d}-{k}.png", base64.b64decode(text)))
    return written


def list_figures(out_dir: str | Path) -> list[Path]:
    """Every PNG under ``<out_dir>/figures``, sorted by name."""
    folder = Path(out_dir) / FIGURES_DIR
    return sorted(folder.glob("*.png")) if folder.is_dir() else []


def list_tables(out_dir: str | Path) -> list[Path]:
    """Every CSV table a notebook saved (``record.table``) under ``<out_dir>/tables``, sorted by name."""
    folder = Path(out_dir) / TABLES_DIR
    return sorted(folder.glob("*.csv")) if folder.is_dir() else []
