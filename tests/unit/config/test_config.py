"""Typed config: composition, overrides, errors naming key and file, docs on every field."""

import json
import re
import subprocess
import sys

import pytest
from pydantic import BaseModel

from slime_async.config import ConfigError, Section, SlimeConfig, load_config
from slime_async.config.moved import MOVED
from tests.support.keys import write_curve_toml
from tests.support.repo import REPO

ALL_TOMLS = sorted(
    p
    for p in [*REPO.glob("configs/**/*.toml"), *REPO.glob("examples/**/*.toml")]
    if p.name != "pyproject.toml"  # examples/plugin_package is a package, not a run's config
)


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_validate():
    cfg = load_config()
    assert isinstance(cfg, SlimeConfig)
    assert cfg.buffer.producer_endpoint.startswith("tcp://127.0.0.1")


def test_files_compose_and_overrides_win(tmp_path):
    a = write(tmp_path, "a.toml", "[learner]\nlr = 1e-3\nnum_steps = 5\n[run]\nmode = 'sync'\n")
    b = write(tmp_path, "b.toml", "[learner]\nlr = 2e-3\n")
    cfg = load_config([a, b], ["learner.num_steps=7", "generator.sampling.top_k=4"])
    assert cfg.learner.lr == 2e-3
    assert cfg.learner.num_steps == 7
    assert cfg.run.mode == "sync"
    assert cfg.generator.sampling.top_k == 4


def test_override_values_parse_as_toml_or_string():
    cfg = load_config(
        [], ["engine.urls=['http://127.0.0.1:1']", "run.name=my-run", "buffer.wal_dir=wal"]
    )
    assert cfg.engine.urls == ["http://127.0.0.1:1"]
    assert cfg.run.name == "my-run"
    assert cfg.buffer.wal_dir == "wal"


def test_misspelled_key_names_key_and_file(tmp_path):
    bad = write(tmp_path, "bad.toml", "[learner]\nlrr = 1e-5\n")
    with pytest.raises(ConfigError) as e:
        load_config([bad])
    msg = str(e.value)
    assert "learner.lrr" in msg and str(bad) in msg and "did you mean 'lr'" in msg


def test_unknown_section_names_file(tmp_path):
    bad = write(tmp_path, "bad.toml", "[lerner]\nlr = 1e-5\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: unknown key 'lerner'"):
        load_config([bad])


def test_wrong_type_names_key_and_origin(tmp_path):
    good = write(tmp_path, "good.toml", "[learner]\nnum_steps = 3\n")
    with pytest.raises(ConfigError, match=r"command line: 'learner.num_steps'"):
        load_config([good], ["learner.num_steps=abc"])
    bad = write(tmp_path, "typed.toml", "[run]\nmode = 'sideways'\n")
    with pytest.raises(ConfigError, match=r"typed\.toml: 'run.mode'"):
        load_config([bad])


def test_missing_file_and_bad_toml_and_bad_override(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config([tmp_path / "nope.toml"])
    broken = write(tmp_path, "broken.toml", "[learner\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config([broken])
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        load_config([], ["=3"])


def test_resolved_config_round_trips_as_json(tmp_path):
    cfg = load_config([], ["learner.lr=3e-4"])
    cfg.write_json(tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text())["learner"]["lr"] == 3e-4
    assert SlimeConfig.read_json(tmp_path / "config.json") == cfg


def _sections(model: type[BaseModel], prefix=""):
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", field
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, Section):
            yield from _sections(ann, f"{prefix}{name}.")


def test_every_field_has_a_one_line_description():
    missing = [k for k, f in _sections(SlimeConfig) if not (f.description or "").strip()]
    assert not missing, f"fields without a docstring: {missing}"


@pytest.mark.parametrize("path", ALL_TOMLS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_toml_validates(path, tmp_path):
    try:
        load_config([path])
    except ConfigError as e:
        # A buffer on a network address needs CurveZMQ keys: composed as the docs say.
        assert "not a loopback address and no CURVE keys" in str(e), e
        load_config([path, write_curve_toml(tmp_path)])


def test_config_import_is_light():
    code = (
        "import sys, slime_async.cli, slime_async.config;"
        "bad=[m for m in ('torch','megatron','zmq','transformers') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_help_lists_commands():
    out = subprocess.run(
        [sys.executable, "-m", "slime_async", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "config" in out


def test_cli_reports_config_errors(tmp_path):
    bad = write(tmp_path, "bad.toml", "[buffer]\nmax_stalenes = 2\n")
    r = subprocess.run(
        [sys.executable, "-m", "slime_async", "config", str(bad)], capture_output=True, text=True
    )
    assert r.returncode == 2
    assert "buffer.max_stalenes" in r.stderr and str(bad) in r.stderr


def test_sync_mode_means_no_staleness_and_push_every_step():
    cfg = load_config([], ["run.mode=sync", "buffer.max_staleness=3", "push.interval=4"])
    assert cfg.buffer.max_staleness == 0 and cfg.push.interval == 1
    cfg = load_config([], ["buffer.max_staleness=3", "push.interval=4"])
    assert cfg.buffer.max_staleness == 3 and cfg.push.interval == 4


def test_buffer_step_size_follows_the_learner_unless_set():
    assert load_config([], ["learner.groups_per_step=5"]).buffer.groups_per_step == 5
    cfg = load_config([], ["learner.groups_per_step=5", "buffer.groups_per_step=7"])
    assert cfg.buffer.groups_per_step == 7


def test_push_interval_beyond_the_staleness_bound_is_refused():
    """The engines lag the learner by up to push.interval - 1 versions: a bound below that would
    hold no admissible batch and hang the run."""
    with pytest.raises(ConfigError) as e:
        load_config([], ["push.interval=4", "buffer.max_staleness=1"])
    msg = str(e.value)
    assert "push.interval" in msg and "buffer.max_staleness" in msg and ">= 3" in msg
    assert "got {" not in msg  # the message, not a dump of the whole config
    assert load_config([], ["push.interval=4", "buffer.max_staleness=3"])
    # Sync mode sets both itself.
    assert load_config([], ["run.mode=sync", "push.interval=4", "buffer.max_staleness=1"])


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo"])
def test_group_size_too_small_for_the_estimator_is_refused(advantage):
    with pytest.raises(ConfigError, match=r"generator\.group_size >= 2") as e:
        load_config([], [f"algo.advantage={advantage}", "generator.group_size=1"])
    assert "algo.advantage" in str(e.value)
    load_config([], ["algo.advantage=reinforce", "generator.group_size=1"])


def test_k1_as_a_kl_loss_is_accepted_and_the_group_size_table_agrees_with_algos():
    # k1 gets the gradient of KL(pi || ref) in algos/kl.py, so it is a valid penalty.
    load_config([], ["algo.kl_coef=0.1", "algo.kl_estimator=k1"])
    from slime_async.algos import ADVANTAGES, min_group_size
    from slime_async.config import _MIN_GROUP_SIZE

    for name in ADVANTAGES.names():
        assert _MIN_GROUP_SIZE.get(name, 1) == min_group_size(name), name


def test_more_mini_batches_than_trajectories_is_refused():
    over = ["learner.groups_per_step=1", "generator.group_size=2", "algo.mini_batches=3"]
    with pytest.raises(ConfigError, match=r"algo\.mini_batches = 3"):
        load_config([], over)


def test_stale_policy_defaults_to_keep_and_is_validated():
    assert load_config().buffer.stale_policy == "keep"
    assert load_config([], ["buffer.stale_policy=drop"]).buffer.stale_policy == "drop"
    with pytest.raises(ConfigError, match="stale_policy"):
        load_config([], ["buffer.stale_policy=discard"])


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_key_is_refused_naming_its_new_place(tmp_path, old):
    """Wherever an old key is set (a file, the command line, a run's config.json), the error
    names the key it became."""
    new = MOVED[old]
    section, key = old.rsplit(".", 1)
    path = tmp_path / "old.toml"
    path.write_text(f"[{section}]\n{key} = 1\n")
    with pytest.raises(
        ConfigError, match=rf"old\.toml: '{re.escape(old)}' is now '{re.escape(new)}'"
    ):
        load_config([path])
    with pytest.raises(ConfigError, match=rf"command line: '{re.escape(old)}' is now"):
        load_config([], [f"{old}=1"])
    tree = SlimeConfig().model_dump(mode="json")
    node = tree
    for part in section.split("."):
        node = node.setdefault(part, {})
    node[key] = 1
    (tmp_path / "config.json").write_text(json.dumps(tree))
    with pytest.raises(ConfigError, match=rf"config\.json: '{re.escape(old)}' is now"):
        SlimeConfig.read_json(tmp_path / "config.json")


def test_the_new_places_of_moved_keys_exist():
    cfg = SlimeConfig()
    for new in MOVED.values():
        node = cfg
        for part in new.split("."):
            node = getattr(node, part)


def test_a_removed_key_says_what_to_set_instead(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text('[buffer.curve]\nclient_public_key = "/k/learner.key"\n')
    with pytest.raises(
        ConfigError, match=r"'buffer.curve.client_public_key' was removed: .*client_secret_key"
    ):
        load_config([path])


def test_a_setting_of_another_builtin_loss_is_refused_naming_it():
    from slime_async.config import AlgoConfig

    with pytest.raises(ValueError, match=r"algo\.m2po_tau is read only by loss m2po"):
        AlgoConfig(loss="tis", m2po_tau=0.02)
    with pytest.raises(ValueError, match=r"algo\.band_growth .* 'ppo_clip'"):
        AlgoConfig(loss="ppo_clip", band_growth=0.5)
    assert AlgoConfig(loss="m2po", m2po_tau=0.02).m2po_tau == 0.02
    assert AlgoConfig(loss="my_pkg.losses:fn", dppo_kl_tau=0.1).dppo_kl_tau == 0.1  # a user's


def test_a_positive_initial_weight_version_of_the_base_model_is_refused():
    """The embedded engine loads the learner's base model (version 0's weights): a label of 5
    would let an engine restarted mid-run pass for one serving the trained version 5."""
    with pytest.raises(ConfigError, match=r"initial_weight_version = '5'.*version 0"):
        load_config([], ["engine.embedded.initial_weight_version='5'"])
    for ok in ("default", "0", "v0"):
        cfg = load_config([], [f"engine.embedded.initial_weight_version='{ok}'"])
        assert cfg.engine.embedded.initial_weight_version == ok
    # An engine of other weights may name them as it likes.
    other = load_config(
        [], ["engine.model_path='/m/step_5'", "engine.embedded.initial_weight_version='5'"]
    )
    assert other.engine.embedded.initial_weight_version == "5"
