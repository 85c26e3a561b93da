"""How many lines a reader follows through one optimisation step of each script, counted from the
source (its syntax tree), so that the count is the same each time: main() from its "# the model"
comment to the end of its training loop (the model and update set up, the loop body), train_step,
the model's forward (the functions and methods a step calls; --whole: the classes whole), the
losses on the paper's default path (JTCSE: the twin), and the length-group wrapper of common.py
that runs the model (length_groups, on_device, in_length_groups). The authors' variants
(--objective authors), the run folder and the data loader are not counted.

  python bench/step_read.py          # the three scripts, each part and the total
  python bench/step_read.py --whole  # the models' classes whole instead of their forward methods
"""
import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WRAPPER = ["length_groups", "on_device", "in_length_groups"]
STEP = {  # each script's losses (paper path) and model: whole classes (--whole), or their methods
    "sscl": (["sscl_loss"], ["SentenceEncoder"],
             ["SentenceEncoder.forward", "SentenceEncoder.pool"]),
    "jtcse": (["nce", "modulus_ratio", "tmc", "jtcse_loss"],
              ["layer_forward", "additive_mask", "Twin"],
              ["layer_forward", "additive_mask", "Twin.forward"]),
    "bellm": (["bellm_loss"], ["attn_mask", "forward", "last_token", "BeLLM", "embed"],
              ["attn_mask", "forward", "last_token", "BeLLM.forward", "embed"]),
}

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--whole", action="store_true", help="count the models' classes whole")


def spans(file, names):
    """{name: its lines} of the top-level functions and classes (and Class.method) named."""
    tree, out = ast.parse((ROOT / file).read_text()), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            out[node.name] = node.end_lineno - node.lineno + 1
        for sub in node.body if isinstance(node, ast.ClassDef) else []:
            if isinstance(sub, ast.FunctionDef) and f"{node.name}.{sub.name}" in names:
                out[f"{node.name}.{sub.name}"] = sub.end_lineno - sub.lineno + 1
    if missing := set(names) - set(out):
        raise SystemExit(f"{file} has no {', '.join(sorted(missing))}: update bench/step_read.py")
    return out


def main_lines(file):
    """main()'s lines from its "# the model" comment to the end of its training loop."""
    src = (ROOT / file).read_text().splitlines()
    main = next(n for n in ast.parse("\n".join(src)).body
                if isinstance(n, ast.FunctionDef) and n.name == "main")
    start = next(i for i in range(main.lineno, main.end_lineno + 1) if "# the model" in src[i - 1])
    loop = next(n for n in main.body if isinstance(n, ast.For))
    return loop.end_lineno - start + 1


def main():
    a = p.parse_args()
    wrapper = sum(spans("common.py", WRAPPER).values())
    for script, (losses, whole, methods) in STEP.items():
        parts = {"main()": main_lines(f"{script}.py"),
                 **spans(f"{script}.py", ["train_step", *losses,
                                          *(whole if a.whole else methods)]),
                 "the wrapper (common.py)": wrapper}
        print(f"{script}: {sum(parts.values())} lines  (" +
              ", ".join(f"{k} {v}" for k, v in parts.items()) + ")")


if __name__ == "__main__":
    main()
