"""The inputs bench/'s scripts read from the environment (MINILM, SMOLLM, WIKI, NLI), checked as the
scripts' flags are: one line naming the variable, exit 2. A module of bench/, not a script."""
import os

import common


def env_input(var, default, kind="model"):
    """The input an environment variable names (bench/: MINILM, SMOLLM, WIKI, NLI), checked as a
    flag's: a file (kind "file"), or a model folder or hub name. -> its value"""
    value = os.environ.get(var, default)
    if kind == "file" and not os.path.isfile(value):
        common.die(f"{var}='{value}' is not a file: set {var} to the training file")
    if kind == "model" and not os.path.isdir(value) and (
            os.path.exists(value) or value.startswith((".", "/", "~")) or value.count("/") > 1):
        common.die(f"{var}='{value}' is not a model folder: set {var} to one, or to a hub name")
    return value


def env_rows(var, default, n, read):
    """The first n rows of the training file an environment variable names (bench/: WIKI, NLI),
    read(path) -> its rows; a missing or shorter file is one line naming the variable."""
    path = env_input(var, default, "file")
    rows = read(path)
    if len(rows) < n:
        common.die(f"{var}='{path}' has {len(rows)} rows; {n} are needed here: set {var} to a "
                   "longer file")
    return rows[:n]
