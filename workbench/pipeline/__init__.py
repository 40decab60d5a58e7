"""The notebook pipeline: papermill runs of the experiment notebooks into reproducible reports.

``workbench report`` is the front door (``workbench.commands.report``). The pieces:

- ``spec``: the YAML spec (``notebooks/pipeline.yaml``), profiles and requirements;
- ``params``: a notebook's ``parameters`` cell, ``--param`` parsing and validation;
- ``runner``: plan (validate everything first), execute each notebook, write manifest and indexes;
- ``environment``: the ``environment.json`` of a run;
- ``export``: HTML exports and PNG figures of an executed notebook;
- ``index``: the run's ``index.html`` (and its ``claims.csv``, ``key_results.csv``), the summary atop each
  notebook's page, ``reports/index.html`` and ``reports/compare.html``;
- ``summary``: what those pages show of a metrics.json: a row per claim (one verdict label, ratio, interval,
  rounds, margin, A/A control, a note), a row per key result, and their CSV;
- ``workbench.atomic`` (one level up, shared with ``workbench.record``): write-to-temp-then-rename file writes.

Core modules never import this package; it imports papermill, nbformat and nbconvert only inside the
functions that use them.
"""

from workbench.pipeline.runner import RunPlan, RunResult, plan_run, run_pipeline
from workbench.pipeline.spec import PROFILES, PipelineSpec, choose_profile, load_spec

__all__ = [
    "PROFILES",
    "PipelineSpec",
    "RunPlan",
    "RunResult",
    "choose_profile",
    "load_spec",
    "plan_run",
    "run_pipeline",
]
