"""`slime-async config`: validate config files, import and check every plug-in, print the config.

The resolved config goes to stdout as JSON; the plug-in checks go to stderr, one line each, so
`slime-async config ... > resolved.json` still writes plain JSON. `slime-async run` makes the same
checks (`check_plugins`) before it starts any process.
"""

from __future__ import annotations

import argparse
import json
import sys

from slime_async.commands import add_config_arguments, config_from_args

HELP = (
    "validate TOML configs plus overrides, import and check every plug-in, and print the "
    "resolved config as JSON"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--section", help="print only this section (e.g. learner)")
    p.add_argument(
        "--no-plugins",
        action="store_true",
        help="do not import the plug-ins (validate the config's keys and types only)",
    )


def check_plugins(cfg, algos: bool = True) -> list[str]:
    """Import every plug-in `cfg` names and check its signature; return one line per plug-in.

    Raises `PluginError` naming the first that fails. The generator's plug-ins come first (they
    import nothing heavy); the algorithm's (`algo.loss`, `algo.advantage`) import torch.
    """
    from slime_async.actors.generator.lifecycle import Lifecycle
    from slime_async.actors.generator.rewards import resolve_reward
    from slime_async.actors.generator.rollout import ROLLOUTS
    from slime_async.utils.plugins import check_signature, import_object

    g = cfg.generator
    lines = []
    if cfg.run.prepare:
        prepare = import_object(cfg.run.prepare, "run.prepare")
        check_signature(prepare, f"run.prepare {cfg.run.prepare!r}", ("cfg",), is_async=False)
        lines.append(f"run.prepare {cfg.run.prepare}: ok, prepare(cfg)")
    ROLLOUTS.resolve(g.rollout, "generator.rollout")
    lines.append(f"generator.rollout {g.rollout}: ok, async rollout(ctx, sample)")
    resolve_reward(g.reward, "generator.reward")
    lines.append(f"generator.reward {g.reward}: ok, reward(sample, response_text, info)")
    if g.lifecycle:
        lc = Lifecycle(g.lifecycle)
        what = "setup(ctx)/teardown()" if lc.kind == "hooks" else "async context manager fn(ctx)"
        lines.append(f"generator.lifecycle {g.lifecycle}: ok, {what}")
    if algos:
        from slime_async.algos import ADVANTAGES, LOSSES

        LOSSES.resolve(cfg.algo.loss, "algo.loss")
        lines.append(f"algo.loss {cfg.algo.loss}: ok")
        ADVANTAGES.resolve(cfg.algo.advantage, "algo.advantage")
        lines.append(f"algo.advantage {cfg.algo.advantage}: ok")
    return lines


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if not args.no_plugins:
        for line in check_plugins(cfg):
            print(f"[slime-async config] {line}", file=sys.stderr)
    data = cfg.model_dump(mode="json")
    if args.section:
        data = data[args.section]
    print(json.dumps(data, indent=2))
    return 0
