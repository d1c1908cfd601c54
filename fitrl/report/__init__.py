"""``fitrl report RUN_DIR``: one self-contained HTML page of a run, from its directory alone.

- :mod:`fitrl.report.load`     reading a run directory (metrics, events, config, plan, samples), tolerant
                                of a run still writing or one that died (no plotly)
- :mod:`fitrl.report.keys`     which metric keys go on which chart, matched by pattern (no plotly)
- :mod:`fitrl.report.figures`  the plotly figures
- :mod:`fitrl.report.page`     the page: sections, the Jinja2 template, plotly.js inlined once
- :mod:`fitrl.report.command`  the ``fitrl report`` subcommand

Import-light: importing the package loads nothing heavy; plotly is the optional extra
``fitrl[report]`` and is imported only when a page is built.
"""
