"""Which pooling an engine uses (model/pooling.py): a sentence-transformers checkpoint's
modules.json / 1_Pooling/config.json, --task, --pooler-config; and the host's
finishing of a pooled vector (normalisation, the Matryoshka cut)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.model.pooling import (PoolingConfig, finish_embedding, resolve_pooling,
                                    sentence_transformers_pooling)


def _st_dir(tmp_path, pooling: dict, normalize: bool):
    mods = [{"type": "sentence_transformers.models.Transformer", "path": ""},
            {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}]
    if normalize:
        mods.append({"type": "sentence_transformers.models.Normalize", "path": "2_Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(mods))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


def test_sentence_transformers_config(tmp_path):
    for d in "abc":
        (tmp_path / d).mkdir()
    last = _st_dir(tmp_path / "a",
                   {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, True)
    assert sentence_transformers_pooling(last) == PoolingConfig("last", True)
    mean = _st_dir(tmp_path / "b",
                   {"pooling_mode_mean_tokens": True}, False)
    assert sentence_transformers_pooling(mean) == PoolingConfig("mean", False)
    cls = _st_dir(tmp_path / "c",
                  {"pooling_mode_cls_token": True}, True)
    with pytest.raises(ValueError, match="not served"):
        sentence_transformers_pooling(cls)
    assert sentence_transformers_pooling(tmp_path) is None      # no modules.json
    assert sentence_transformers_pooling(None) is None


def test_task_and_overrides(tmp_path):
    (tmp_path / "st").mkdir()
    st = _st_dir(tmp_path / "st", {"pooling_mode_mean_tokens": True}, True)
    assert resolve_pooling("auto", None, st) == PoolingConfig("mean", True)
    assert resolve_pooling("generate", None, st) is None
    assert resolve_pooling("auto", None, tmp_path) is None     # a plain checkpoint
    assert resolve_pooling("embed", None, None) == PoolingConfig("last", True)
    assert resolve_pooling("embed", {"pooling_type": "MEAN", "normalize": False},
                           None) == PoolingConfig("mean", False)
    assert resolve_pooling("auto", {"normalize": False}, st) == PoolingConfig("mean", False)
    for bad in ({"pooling_type": "CLS"}, {"normalize": "yes"}, {"dims": 3}):
        with pytest.raises(ValueError, match="pooler_config"):
            resolve_pooling("embed", bad, None)


def test_finish_embedding():
    v = np.array([3.0, 4.0, 12.0], np.float32)
    assert np.allclose(finish_embedding(v, True), v / 13)
    assert np.allclose(finish_embedding(v, True, 2), [0.6, 0.8])     # cut, then unit
    assert np.array_equal(finish_embedding(v, False, 2), [3.0, 4.0])
    assert finish_embedding(v, False).dtype == np.float32
