"""pagedkv.validation: the argument checks the library, the engine and the command-line tools share
accept what they document and refuse the rest with TypeError / ValueError naming the argument."""
import argparse

import numpy as np
import pytest
import torch

from pagedkv.validation import check_bool, check_float, check_int, float_at_least, int_at_least, token_id_list


def test_check_int():
    assert check_int("n", 3) == 3 and type(check_int("n", np.int64(3))) is int
    assert check_int("n", 0, minimum=0, maximum=0) == 0
    for bad in (True, 3.0, "3", None, torch.tensor(3)):
        with pytest.raises(TypeError, match="n must be an int"):
            check_int("n", bad)
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        check_int("n", 0, minimum=1)
    with pytest.raises(ValueError, match="n must be <= 5, got 6"):
        check_int("n", 6, maximum=5)


def test_check_float_and_bool():
    assert check_float("x", 1) == 1.0 and check_float("x", np.float32(0.5)) == 0.5
    with pytest.raises(TypeError, match="x must be a number"):
        check_float("x", False)
    with pytest.raises(ValueError, match="x must be finite"):
        check_float("x", float("nan"))
    assert check_bool("flag", True) is True
    with pytest.raises(TypeError, match="flag must be a bool"):
        check_bool("flag", 1)


def test_token_id_list():
    want = [3, 4]
    for ids in ([3, 4], (3, 4), np.array(want), np.array(want, dtype=np.uint8), torch.tensor(want),
                [np.int64(3), 4]):
        assert token_id_list("ids", ids) == want
    for bad, words in (("34", "sequence of token ids"), (3, "sequence of token ids"), ({3, 4}, "list of token ids"),
                       ([3, 4.0], r"ids\[1\] must be an int"), ([True], r"ids\[0\]"),
                       (np.array([[3, 4]]), "1-D"), (torch.tensor([3.0]), "integer")):
        with pytest.raises(TypeError, match=words):
            token_id_list("ids", bad)


def test_command_line_flags():
    assert int_at_least(1)("4") == 4 and float_at_least(0)("0.5") == 0.5
    for parse, text, words in ((int_at_least(1), "0", "must be >= 1, got 0"),
                               (int_at_least(1), "x", "expected an integer"),
                               (float_at_least(0), "-1", "must be a finite number >= 0"),
                               (float_at_least(0), "nan", "finite"), (float_at_least(0), "x", "expected a number")):
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            parse(text)
