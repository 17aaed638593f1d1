"""The Octavo cache dir follows OCTAVO_CACHE_DIR, then XDG_CACHE_HOME, then ~/.cache."""

from __future__ import annotations

from octavo.cache_dir import cache_root


def test_cache_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("OCTAVO_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "octavo"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "octavo"
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
