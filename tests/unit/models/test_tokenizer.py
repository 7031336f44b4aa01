"""`load_tokenizer`: a directory naming `PreTrainedTokenizerFast` (our tiny models) is loaded with
that class without importing AutoTokenizer's family mappings (about 3 s of CPU a process); any
other directory goes through AutoTokenizer. Both give the same ids for the same files."""

import json
import shutil
import subprocess
import sys

from slime_async.models.toy import make_tiny_model

_LOAD = (
    "import sys\n"
    "from slime_async.models.tokenizer import load_tokenizer\n"
    "tok = load_tokenizer(sys.argv[1])\n"
    "print('tokenization_auto' if 'transformers.models.auto.tokenization_auto' in sys.modules"
    " else 'direct', tok.encode('12+3=15'))\n"
)


def _load(path) -> tuple[str, str]:
    """(how it was loaded, the ids of a fixed text) in a fresh process: sys.modules as a role's."""
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD, str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    how, ids = proc.stdout.strip().splitlines()[-1].split(" ", 1)
    return how, ids


def test_a_named_fast_tokenizer_skips_autotokenizer_and_others_use_it(tmp_path):
    model = make_tiny_model(tmp_path / "model", "qwen3", seed=0)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    how, ids = _load(model)
    assert how == "direct"

    other = tmp_path / "other"
    shutil.copytree(model, other)
    del cfg["tokenizer_class"]
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert _load(other) == ("tokenization_auto", ids)
