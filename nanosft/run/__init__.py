"""A training run's safety and set-up, above the pieces they check: its checkpoints (written
atomically, resumed exactly), its output folder and the lock that keeps it one run's, the checks
made at its start (preflight), and SFTTrainer.__init__'s argument, model-id and dataset checks.
The Trainer and SFTTrainer import these on use; nothing below them imports this package.
"""
