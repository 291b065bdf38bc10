"""``dmltrain report``: compare MLflow runs in one Markdown and one HTML page.

``dmltrain report --experiment NAME [--runs ID,...] [--out DIR]`` collects the runs of an
experiment (all of them, or the ids / run names given; a parent run, such as a Tune search or
a study, stands for its children) and writes to ``DIR`` (default ``reports/<experiment>``):

* ``report.md`` and ``report.html``: a table of the runs with the params that differ between
  them, a table of final metrics (the best value in bold among the runs it can be compared
  with; speed as the steady state the study reads too), the loss and Recall@1 curves of all
  runs overlaid, each run's description and plots (latest of each kind shown, all linked), and
  links back to the MLflow UI in its model-training view (each run, the experiment, the run
  comparison view); one run gets a page of its own, with its evaluations step by step;
* ``loss.png``, ``recall_at_1.png``: the overlaid curves;
* ``runs.csv``: both tables as one CSV;
* ``runs/<run>/plots/``: each run's plot artifacts.

The HTML page embeds its images, so it can be mailed or attached on its own. Every file is
written atomically. MLflow does not allow ``@`` in metric keys, so ``recall@1`` is stored as
``eval/recall_at_1`` and ``map@r`` as ``eval/ranking/map_at_r``
(:func:`dmltrain.tracking.names.metric_key`); the report shows the evaluation's names again.

Modules: :mod:`.runs` (the runs chosen and what is collected of each from MLflow),
:mod:`.compare` (the params that differ, the metric columns, which runs compare, the tables, the curves, the CSV),
:mod:`.pages` (the Markdown and HTML pages), :mod:`.cli` (``dmltrain report``: the whole report).
"""
