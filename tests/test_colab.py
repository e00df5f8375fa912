"""Colab: its kernel's shell is ``google.colab._shell.Shell``, a subclass of ipykernel's
``ZMQInteractiveShell`` whose class name is not ``ZMQInteractiveShell``. The Animator
must still draw inline there (it wrote PNG files when the shell was recognized by name)."""
from __future__ import annotations

import sys
import types

import IPython
import pytest
from ipykernel.zmqshell import ZMQInteractiveShell

from dpbook import plot


@pytest.fixture
def shell(monkeypatch):
    """``shell(cls)``: make ``get_ipython()`` return an instance of ``cls``."""
    def use(cls):
        instance = cls.__new__(cls)            # no kernel behind it: __init__ is not run
        monkeypatch.setattr(IPython, "get_ipython", lambda: instance)
        return instance
    return use


def _colab_shell_class(monkeypatch):
    """A stand-in ``google.colab._shell.Shell``, in a module of that name."""
    module = types.ModuleType("google.colab._shell")
    Shell = type("Shell", (ZMQInteractiveShell,), {"__module__": module.__name__})
    module.Shell = Shell
    for name in ("google", "google.colab"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "google.colab._shell", module)
    return Shell


def test_colab_shell_is_a_notebook_and_the_animator_draws_inline(shell, monkeypatch, tmp_path):
    Shell = _colab_shell_class(monkeypatch)
    assert Shell.__name__ == "Shell" and Shell.__module__ == "google.colab._shell"
    shell(Shell)
    assert plot.in_notebook()
    shown = []
    monkeypatch.setattr("IPython.display.display",
                        lambda obj, display_id=None: shown.append(obj) or
                        types.SimpleNamespace(update=shown.append))
    monkeypatch.chdir(tmp_path)
    animator = plot.Animator(legend=["loss"])
    assert animator.live
    animator.add(1, 0.5)
    animator.add(2, 0.25)
    assert shown, "nothing was displayed inline"
    assert not list(tmp_path.glob("animator-*")), "the Animator wrote a file instead"


def test_jupyter_is_a_notebook_and_terminal_ipython_is_not(shell):
    shell(ZMQInteractiveShell)
    assert plot.in_notebook()
    from IPython.terminal.interactiveshell import TerminalInteractiveShell
    shell(TerminalInteractiveShell)
    assert not plot.in_notebook()
