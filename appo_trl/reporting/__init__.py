"""Floor 5: what a run shows and publishes.

- `console`: one canonical metric name per quantity, and one console line per step;
- `trackers`: `report_to` checked before the model loads (wandb offline without credentials);
- `rollout_dump`: sample trajectories written as JSON lines; `rollout_read` reads them back, damaged or not;
- `rollout_page`: the rollout viewer (one HTML page, or served live; `viewer/` holds its script and style);
- `atomic`: files written whole or not at all (a full disk is one line);
- `hub`: the model card and one push of the final model.

Imports `configs` and `data` below it; never `trainer`, `evaluation`, `stages`, `synthetic` or `cli`, so the
trainer, the stages and the CLI can all report through it.
"""
