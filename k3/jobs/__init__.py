"""The main job: SFT warm start (`sft`), the GSPO loop (`rl`), its configuration (`config`), episodes and report.

Nothing is imported here: `k3.jobs.config` stays cheap to load (the CLI checks a config before torch work), and
this file exists so that setuptools' find_packages puts the package in the wheel (`pip install .`)."""
