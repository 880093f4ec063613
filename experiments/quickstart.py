"""The training run's former name: `python -m experiments.quickstart` is
`python -m experiments.train` (experiments/train.py) with its old default workdir,
runs/quickstart, so a run started under this name resumes under it."""
from experiments.train import main

if __name__ == "__main__":
    main(default_workdir="runs/quickstart")
