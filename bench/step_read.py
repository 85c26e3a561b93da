"""How many lines a reader reads to follow one optimisation step of each script, counted from the
source (its syntax tree), so that the count is the same each time:
  main()             from its "# the model" comment to the end of its training loop
  train_step         the step, as the loop calls it
  the losses         on the paper's default path (JTCSE: the twin)
  the model          its classes and functions whole (__init__ and every method), and the
                     functions of the script that build it as the step trains it
  the update         an optimiser class of the script's own (SSCL: AdamW421)
  the data loader    the steps' tokenised micro-batches
  common.py          what the step calls there: the steps' rows, the length-group wrapper and the
                     background loader
  harness.py         each function of harness.py that the loop calls (run.X, meter.X, harness.X),
                     its own lines
The authors' variants (--objective authors), the dev score and the run folder's files are not
counted. --nanogpt DIR and --cleanrl DIR count those references by the same rules (a clone of each:
nanoGPT's train.py and model.py, cleanrl's cleanrl/ppo.py).

  python bench/step_read.py
  python bench/step_read.py --nanogpt ~/src/nanoGPT --cleanrl ~/src/cleanrl
"""
import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP = {  # each script's parts, by the names of its top-level functions and classes
    "sscl": {"the losses": ["sscl_loss"],
             "the model": ["SentenceEncoder"],
             "the update": ["AdamW421"],
             "the data loader": ["micro_batches"]},
    "jtcse": {"the losses": ["nce", "modulus_ratio", "tmc", "jtcse_loss"],
              "the model": ["layer_forward", "additive_mask", "Twin", "global_views",
                            "load_towers"],
              "the update": [],
              "the data loader": ["micro_batches"]},
    "bellm": {"the losses": ["bellm_loss"],
              "the model": ["attn_mask", "decoder_forward", "last_token", "BeLLM", "embed",
                            "base_dtype", "load_decoder", "add_lora", "cast_frozen_linears"],
              "the update": [],
              "the data loader": ["fill", "prompted_batch", "micro_batches"]},
}
COMMON = ["step_rows", "length_groups", "on_device", "in_length_groups", "_in_groups", "ahead"]
HARNESS_OBJECTS = ("run", "meter", "harness")  # the names main() calls harness.py through
# the references, counted alike: the training script from the line that builds the model to the
# end of its loop, and the classes and functions a step runs
NANOGPT = {"train.py": "# model init",
           "model.py": ["LayerNorm", "CausalSelfAttention", "MLP", "Block", "GPTConfig", "GPT"],
           "train.py ": ["get_batch", "get_lr"]}
CLEANRL = {"cleanrl/ppo.py": "agent = Agent(envs)",
           "cleanrl/ppo.py ": ["make_env", "layer_init", "Agent"]}

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--nanogpt", metavar="DIR", help="a clone of nanoGPT: count it too")
p.add_argument("--cleanrl", metavar="DIR", help="a clone of cleanrl: count it too")


def definitions(path):
    """{name: node} of a file's top-level functions and classes, and its methods as Class.name."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = node
        if isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef):
                    found[f"{node.name}.{sub.name}"] = sub
    return found


def lines_of(path, names):
    """The lines of the named top-level functions and classes of a file, together."""
    found = definitions(path)
    missing = sorted(set(names) - set(found))
    if missing:
        raise SystemExit(f"{path.name} has no {', '.join(missing)}: update bench/step_read.py")
    return sum(found[n].end_lineno - found[n].lineno + 1 for n in names)


def loop_of(path):
    """main()'s node and its training loop (its last for or while statement)."""
    tree = ast.parse(path.read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    loops = [n for n in main.body if isinstance(n, (ast.For, ast.While))]
    return main, loops[-1]


def span(path, marker, end):
    """The lines from the first line that holds marker to line end."""
    text = path.read_text().splitlines()
    start = next((i for i, line in enumerate(text, 1) if marker in line), None)
    if start is None:
        raise SystemExit(f"{path.name} has no line with {marker!r}: update bench/step_read.py")
    return end - start + 1


def harness_calls(loop):
    """The names of what the loop calls through run., meter. and harness. (sorted, once each): each
    call, and each function handed on (harness.gather); not a value read (meter.tokens)."""
    functions = {key.split(".")[-1] for key, node in definitions(ROOT / "harness.py").items()
                 if isinstance(node, ast.FunctionDef)}
    called = set()
    named = set()
    for node in ast.walk(loop):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            called.add(node.func)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in HARNESS_OBJECTS:
            named.add(node)
    return sorted({node.attr for node in named if node in called or node.attr in functions})


def harness_lines(names):
    """The lines of harness.py's functions and methods of these names (a method found in any
    class; a name found nowhere stops the count)."""
    found = definitions(ROOT / "harness.py")
    total = 0
    for name in names:
        nodes = [node for key, node in found.items()
                 if key == name or key.endswith(f".{name}")]
        nodes = [node for node in nodes if isinstance(node, ast.FunctionDef)]
        if not nodes:
            raise SystemExit(f"harness.py has no {name}: update bench/step_read.py")
        total += nodes[0].end_lineno - nodes[0].lineno + 1
    return total


def script_parts(script):
    """{part: lines} of one step of script."""
    path = ROOT / f"{script}.py"
    _, loop = loop_of(path)
    parts = {"main()": span(path, "# the model", loop.end_lineno),
             "train_step": lines_of(path, ["train_step"])}
    for part, names in STEP[script].items():
        parts[part] = lines_of(path, names)
    parts["common.py"] = lines_of(ROOT / "common.py", COMMON)
    parts["harness.py"] = harness_lines(harness_calls(loop))
    return parts


def reference_parts(folder, files):
    """{part: lines} of a reference (NANOGPT, CLEANRL) in a clone at folder."""
    parts = {}
    for name, what in files.items():
        path = Path(folder) / name.strip()
        if isinstance(what, str):  # the script: from the model's construction to its loop's end
            _, loop = loop_of(path) if "def main" in path.read_text() else (None, None)
            end = loop.end_lineno if loop else last_loop_end(path)
            parts[f"{name.strip()}: the loop"] = span(path, what, end)
        else:
            parts[f"{name.strip()}: {', '.join(what)}"] = lines_of(path, what)
    return parts


def last_loop_end(path):
    """The last line of a module's last top-level for or while loop (a script without main())."""
    tree = ast.parse(path.read_text())
    loops = [n for n in tree.body if isinstance(n, (ast.For, ast.While))]
    if not loops:  # under `if __name__ == "__main__":`
        block = [n for n in tree.body if isinstance(n, ast.If)][-1]
        loops = [n for n in block.body if isinstance(n, (ast.For, ast.While))]
    return loops[-1].end_lineno


def show(name, parts):
    listed = ", ".join(f"{k} {v}" for k, v in parts.items())
    print(f"{name}: {sum(parts.values())} lines  ({listed})")


def main():
    a = p.parse_args()
    for script in STEP:
        show(script, script_parts(script))
    if a.nanogpt:
        show("nanoGPT", reference_parts(a.nanogpt, NANOGPT))
    if a.cleanrl:
        show("cleanrl", reference_parts(a.cleanrl, CLEANRL))


if __name__ == "__main__":
    main()
