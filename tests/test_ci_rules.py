"""The suite's own rule: only tests marked ``gpu`` may skip."""

from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()


def test_unmarked_skip_fails_the_run(pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    pytester.makepyfile(
        """
        import pytest

        def test_ok():
            assert 1 + 1 == 2

        @pytest.mark.gpu
        def test_gpu_may_skip():
            pytest.skip("no GPU here")

        def test_silent_skip():
            pytest.skip("forgot a dependency")
        """
    )
    result = pytester.runpytest()
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*1 test(s) skipped without the gpu marker*", "*test_silent_skip*"])


def test_gpu_skip_alone_passes(pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpu
        def test_gpu_may_skip():
            pytest.skip("no GPU here")
        """
    )
    assert pytester.runpytest().ret == 0
