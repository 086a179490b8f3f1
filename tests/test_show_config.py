"""show_config: printed for people, or returned as a dict for programs (mode="dicts")."""
import json

import pytest

import manyheads as mh


def test_dicts_mode_returns_the_configuration_and_prints_nothing(capsys):
    c = mh.show_config(mode="dicts")
    assert capsys.readouterr().out == ""
    assert c["version"] == mh.__version__
    assert c["kernel_isa"] == mh.kernel_isa()
    assert c["kernel_isa"] in c["isa_compiled"] and c["kernel_isa"] in c["isa_supported_by_cpu"]
    assert isinstance(c["openmp"], bool)
    assert c["num_threads"] == mh.get_num_threads()


def test_dicts_mode_is_plain_data_that_json_can_write():
    c = mh.show_config(mode="dicts")
    assert json.loads(json.dumps(c)) == c


def test_each_call_returns_a_new_dict():
    first = mh.show_config(mode="dicts")
    first["kernel_isa"] = "changed by the caller"
    assert mh.show_config(mode="dicts")["kernel_isa"] == mh.kernel_isa()


def test_the_thread_count_set_is_reported_and_none_means_the_default():
    mh.set_num_threads(None)
    try:
        assert mh.show_config(mode="dicts")["num_threads_set"] is None
        mh.set_num_threads(1)
        c = mh.show_config(mode="dicts")
        assert c["num_threads_set"] == 1 and c["num_threads"] == 1
    finally:
        mh.set_num_threads(None)
    assert mh.show_config(mode="dicts")["num_threads_set"] is None


def test_stdout_mode_prints_what_the_dict_holds(capsys):
    assert mh.show_config() is None
    printed = capsys.readouterr().out
    assert mh.show_config(mode="stdout") is None
    assert capsys.readouterr().out == printed
    c = mh.show_config(mode="dicts")
    assert printed.startswith(f"manyheads {c['version']}\n")
    assert f"kernel path      : {c['kernel_isa']}" in printed
    assert f"threads          : {c['num_threads']}" in printed


@pytest.mark.parametrize("mode, error", [("dict", ValueError), ("STDOUT", ValueError),
                                         (None, TypeError), (1, TypeError)])
def test_an_unknown_mode_is_refused_naming_the_modes(mode, error, capsys):
    with pytest.raises(error, match="'stdout', 'dicts'"):
        mh.show_config(mode=mode)
    assert capsys.readouterr().out == ""
