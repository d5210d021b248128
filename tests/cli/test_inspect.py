"""``aloe inspect``: the summary of an artifact, its reading included."""

import json

from helpers import random_operator

from aloe_cli.main import main


def test_inspect_states_what_the_gates_read(tmp_path, capsys):
    random_operator(3, 8, 5, layer=2, reading_decay=0.7).save(tmp_path / "running")
    random_operator(2, 8, 5, layer=2).save(tmp_path / "plain")
    assert main(["inspect", str(tmp_path / "running")]) == 0
    running = json.loads(capsys.readouterr().out)
    assert main(["inspect", str(tmp_path / "plain")]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert (running["n"], running["layer"], running["reading_decay"]) == (3, 2, 0.7)
    assert (plain["n"], plain["reading_decay"]) == (2, 0.0)
