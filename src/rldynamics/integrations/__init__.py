"""Where users already are: the health monitor over other trainers' logs (`rldyn doctor`,
`doctor.py`) and inside TRL's trainers (`trl.py`, a `transformers.TrainerCallback`), with one table
per trainer mapping its metric names to the monitor's signals (`signals.py`). Imports point down:
analysis/ and plots/, never the trainer."""
