"""The analysis of class-subsampling studies: what a study's runs measured, read and reported.

:mod:`.results` holds a study's points and their repeats, the measures read of each run, the statistics over
repeats, the trade-off against ratio 1, and the Markdown and CSV tables and plots that ``dmltrain study`` writes and
logs. The orchestration (planning the points, training them on Ray, the parent MLflow run) stays in
:mod:`cluster.study`, which calls this package; nothing here starts or talks to a cluster.
"""
