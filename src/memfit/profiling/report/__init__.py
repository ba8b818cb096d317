"""Reports of a profiled run: the offline HTML file and a PNG of the timeline.

>>> from memfit.profiling.report import render_html, write_html, write_png
"""

from memfit.profiling.report.html import embed_json, render_html, write_html
from memfit.profiling.report.png import write_png

__all__ = ["embed_json", "render_html", "write_html", "write_png"]
