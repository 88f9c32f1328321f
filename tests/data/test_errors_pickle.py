import pickle

from psrec.data.errors import BadRowError


def test_bad_row_error_survives_pickling() -> None:
    """Errors raised in a Ray trainer reach the driver pickled; they must keep file, line and text."""
    error = pickle.loads(pickle.dumps(BadRowError("data.tsv", "line 7", "bad number", "1\tx")))
    assert isinstance(error, BadRowError)
    assert (error.path, error.location, error.reason, error.text) == (
        "data.tsv",
        "line 7",
        "bad number",
        "1\tx",
    )
    assert str(error) == "data.tsv, line 7: bad number: '1\\tx'"
