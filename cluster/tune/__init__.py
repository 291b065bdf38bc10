"""``dmltrain tune``: a Ray Tune search over Ray Train V2 trainings, every trial an MLflow child run.

``dmltrain tune CONFIG [overrides] --space SPACE.yaml --trials N [--scheduler asha]`` samples
configs from ``SPACE.yaml`` and trains each one. The search space is YAML over dotted config
keys (see ``configs/tune/``)::

    metric: recall@1          # an evaluation metric (the ASHA metric and the one that picks the best trial)
    mode: max                 # optional; every evaluation metric is better when higher
    space:
      optim.lr: {loguniform: [1.0e-4, 1.0e-1]}
      loss.classifier.params.temperature: {uniform: [0.03, 0.1]}
      loss.classifier.sample_ratio: {choice: [1.0, 0.5, 0.1]}
      data.samples_per_class: {grid: [2, 4]}

``uniform`` and ``loguniform`` take ``[low, high]``; ``choice`` samples one of its values;
``grid`` tries every value, and as in Ray Tune the grid is repeated ``--trials`` times (the
search runs grid size × trials trials). A key may name a whole section with mappings as
values, which are merged into it: ``data: {choice: [{batch_size: 75, samples_per_class: 5},
{batch_size: 150, samples_per_class: 3}]}`` tunes P×K as pairs. The file is checked against the config before anything
starts: an unknown distribution, bad bounds, a key the config does not have or a value the
config refuses stops with one line naming the key. Every sampled config is validated again in
its trial; a combination the config refuses fails that trial only.

Each trial is a Tune function trial that builds the run's ``TorchTrainer`` (the same one
``dmltrain train`` uses) and calls ``fit()``. Its evaluations reach Tune through a Ray Train
callback, one Tune result per evaluation during training (the untrained model's evaluation
is not one), so ``training_iteration`` counts evaluations and ``--scheduler asha`` stops weak
trials after ``--grace-period`` evaluations. Rank 0 logs the trial into its own MLflow run, a
child of the search's parent run; a trial stopped early ends ``KILLED`` and tagged
``dmltrain.tune.stopped_early``.

At the end: the results table is printed and saved (``results.md``, ``results.csv``), the best
trial's config is written as a ready-to-run YAML (``best_config.yaml``) and printed, and the
parent run receives the space, the table, the YAML and the best trial's metrics. The best trial
is the one with the best value of the metric at any of its evaluations, which is also the
checkpoint its training keeps as ``best_model``. Outputs live in ``<storage>/<name>/``
(``cluster.storage_path``, else ``train.output_dir``), the trials' trainings in its ``runs/``.
Running the same command with ``--name NAME --resume`` resumes an interrupted search: finished
trials are kept, unfinished ones continue from their last checkpoint. Tune unpickles a search's
state to resume it, so only a search this user's dmltrain wrote is resumed (its state is sealed
with the user's key, :mod:`.sealed_state`); without ``--resume`` a folder that holds a search is
refused.

On a small machine the trials share the CPUs: each trial's driver takes ``--trial-cpus``
(default 0.1) and its workers ``cluster.cpus_per_worker`` each (fractions allowed), and at most
as many trials run at once as the cluster's CPUs (GPUs with ``cluster.use_gpu``) can hold.

Modules: :mod:`.space` (the space file, its checks against the config, sampled values into a
config tree), :mod:`.trial` (one trial: its config, its MLflow child run, its training, the
callback that forwards evaluations to Tune), :mod:`.results` (trial rows from Tune and from the
trials' MLflow runs, the table, the best config), :mod:`.search` (the Tuner and the parent run),
:mod:`.sealed_state` (the Tune state, authenticated), :mod:`.cli` (``dmltrain tune``).
"""
