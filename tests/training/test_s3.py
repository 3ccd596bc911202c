"""training.s3: the S3 errors a user can fix become one line naming the URL and the fix."""

from __future__ import annotations

import pytest

from tests.conftest import free_port
from training import s3
from training.errors import UserError


def test_missing_bucket_names_it(s3_endpoint: str) -> None:
    with pytest.raises(UserError, match=r"s3://no-such-bucket-here: bucket does not exist"):
        s3.get_bytes("s3://no-such-bucket-here/features/index.json")


def test_missing_object_names_it(s3_bucket: str) -> None:
    with pytest.raises(UserError, match=rf"s3://{s3_bucket}/absent.json: no such object"):
        s3.get_bytes(f"s3://{s3_bucket}/absent.json")


def test_unreachable_endpoint_is_one_line(monkeypatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = s3.client(closed, max_attempts=1)
    with pytest.raises(UserError, match=r"s3://b/k: cannot reach S3 .* check the node's route to S3") as err:
        s3.get_bytes("s3://b/k", s3=client)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("url", ["bucket/key", "s3://", "s3:///key", "/local/path"])
def test_malformed_urls_are_rejected(url: str) -> None:
    with pytest.raises(UserError, match="is not an S3 URL"):
        s3.parse_s3_url(url)


def test_round_trip_upload_list_sync(s3_bucket: str, tmp_path) -> None:
    (tmp_path / "src" / "sub").mkdir(parents=True)
    (tmp_path / "src" / "a.txt").write_text("alpha")
    (tmp_path / "src" / "sub" / "b.txt").write_text("beta")
    for rel in ("a.txt", "sub/b.txt"):
        s3.upload_file(tmp_path / "src" / rel, f"s3://{s3_bucket}/model/{rel}")
    assert s3.list_keys(f"s3://{s3_bucket}/model") == ["a.txt", "sub/b.txt"]
    out = s3.sync_down(f"s3://{s3_bucket}/model", tmp_path / "dst")
    assert (out / "a.txt").read_text() == "alpha" and (out / "sub" / "b.txt").read_text() == "beta"
    with pytest.raises(UserError, match="no objects under this prefix"):
        s3.sync_down(f"s3://{s3_bucket}/nothing", tmp_path / "none")
