"""The generator's check of how the engines treat `sampling_seed` (slime_async/actors/generator/
seeding.py), against the rules read out of SGLang 0.5.23's wheel."""

import asyncio
import logging
import re

import pytest

from slime_async.actors.engine.client import EngineError
from slime_async.actors.generator import seeding
from slime_async.actors.generator.loop import GeneratorError
from tests.support import sglang_wheel as sw

SGLANG_OFF = {"enable_deterministic_inference": False, "tp_size": 1}
SGLANG_ON = {"enable_deterministic_inference": True, "tp_size": 1}
EMBEDDED = {"engine": "slime_async.embedded", "strict_sglang": False}
STRICT = {"engine": "slime_async.embedded", "strict_sglang": True}


def test_sglang_honours_a_seed_only_with_deterministic_inference_and_gives_the_rest_42():
    """What the check rests on, in the wheel: the batch's seeds exist only under deterministic
    inference, a request without one gets 42, the flag is one of ServerArgs' flat fields
    (/server_info's keys) and it sets the sampling backend to pytorch."""
    api = sw.api_or_skip()
    info = api.files.read("srt/sampling/sampling_batch_info.py")
    assert "enable_deterministic = get_exec().deterministic.enable_deterministic_inference" in info
    seeds = info[info.index("sampling_seed = (") :][:600]
    assert "if r.sampling_params.sampling_seed is not None" in seeds
    assert re.search(r"else\s+42", seeds) and re.search(
        r"if enable_deterministic\s+else None", seeds
    )
    assert '"enable_deterministic_inference"' in api.files.read("srt/arg_groups/field_order.py")
    overrides = api.files.read("srt/arg_groups/overrides.py")
    body = overrides[overrides.index("def _deterministic_sampling_backend") :][:400]
    assert 'return {"sampling_backend": "pytorch"}' in body


@pytest.mark.parametrize(
    "info, deterministic, honoured",
    [
        (SGLANG_OFF, False, False),
        (SGLANG_ON, True, True),
        ({**EMBEDDED, "enable_deterministic_inference": False}, False, True),
        ({**EMBEDDED, "enable_deterministic_inference": True}, True, True),
        ({**STRICT, "enable_deterministic_inference": False}, False, False),
        ({**STRICT, "enable_deterministic_inference": True}, True, True),
        ({"model_path": "m"}, False, None),  # a router: says nothing
        ({"model_path": "m"}, True, None),
    ],
)
def test_what_each_engine_honours(info, deterministic, honoured):
    assert seeding.check("http://e", info, deterministic) is honoured


def test_a_deterministic_engine_without_the_setting_is_refused_naming_the_collapse():
    with pytest.raises(seeding.SeedingMismatch, match="seed 42, so the rollouts of a prompt"):
        seeding.check("http://e:1", SGLANG_ON, deterministic=False)
    assert issubclass(seeding.SeedingMismatch, GeneratorError)  # the generator exits with it


def test_the_setting_without_a_deterministic_engine_is_refused_as_doing_nothing():
    with pytest.raises(seeding.SeedingMismatch, match="runs without --enable-deterministic"):
        seeding.check("http://e:1", SGLANG_OFF, deterministic=True)


class _Client:
    def __init__(self, url, info):
        self.url, self.info = url, info

    async def get_server_info(self):
        if isinstance(self.info, Exception):
            raise self.info
        return self.info


def test_seeded_evaluation_on_engines_that_ignore_seeds_is_a_warning_with_their_names(caplog):
    clients = [
        _Client("http://a", SGLANG_OFF),
        _Client("http://b", EMBEDDED),
        _Client("http://c", EngineError("http://c", "GET /server_info", "refused")),
    ]
    with caplog.at_level(logging.INFO, logger="slime_async.generator"):
        got = asyncio.run(seeding.check_engines(clients, False, eval_seeded=True))
    assert got == {"http://a": False, "http://b": True, "http://c": None}
    assert "eval.seed: http://a ignore sampling_seed" in caplog.text
    assert "http://c /server_info did not answer" in caplog.text
    caplog.clear()
    asyncio.run(seeding.check_engines(clients[:2], False, eval_seeded=False))
    assert "eval.seed" not in caplog.text
