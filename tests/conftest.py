"""Fixtures of the whole session."""
import pytest

from runs_ahead import RunsAhead


@pytest.fixture(scope="session", autouse=True)
def runs_ahead(request, tmp_path_factory):
    """The subprocesses of the session's selected tests that ``runs_ahead.runs`` marks,
    started with the session (see ``runs_ahead.py``)."""
    runs = RunsAhead(request.session.items, tmp_path_factory)
    yield runs
    runs.close()
