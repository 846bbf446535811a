"""Push an export folder to the Hugging Face Hub (``huggingface_hub.HfApi.upload_folder``).

The token comes from the environment (``HF_TOKEN``) or huggingface_hub's stored login
(``get_token()``), never from the recipe; it is never printed, logged or written. Before uploading,
the export is checked: no file may contain the token, and the text files (card, config, recipe)
may not contain absolute local paths (the home folder, the export's own path, the working
directory). Failures -- no token, a rejected token, an unreachable or failing server -- raise
:class:`HubPushError` with one actionable line; the local export is never touched.

``HF_ENDPOINT`` (read by huggingface_hub at import) or ``endpoint=`` selects the server; tests point
it at a local Hub-compatible server on 127.0.0.1.
"""

from __future__ import annotations

import os
from pathlib import Path

TEXT_SUFFIXES = (".json", ".md", ".yaml", ".yml", ".txt", ".py", ".jinja")


class HubPushError(RuntimeError):
    """The push failed; the message says why and what to do. The local export is intact."""


def resolve_token(explicit: str | None = None) -> str:
    from huggingface_hub import get_token

    token = explicit or get_token()
    if not token:
        raise HubPushError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (the recipe never holds tokens)")
    return token


def check_export_is_clean(export_dir: Path, token: str) -> None:
    """Refuse to upload a folder whose files contain the token or, for text files, local paths."""
    forbidden_paths = {str(Path.home()), str(export_dir.resolve()), os.getcwd()} - {"/", ""}
    for path in sorted(export_dir.rglob("*")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        if token.encode() in data:
            raise HubPushError(f"{path.name} contains the Hub token: refusing to upload (delete the token from it)")
        if path.suffix in TEXT_SUFFIXES:
            text = data.decode("utf-8", errors="replace")
            for local in forbidden_paths:
                if local in text:
                    raise HubPushError(f"{path.relative_to(export_dir)} contains a local path ({_redact(local)}...): "
                                       f"refusing to upload; the export should carry no local paths")


def _redact(path: str) -> str:
    return path[:8]


def push_export(export_dir: str | Path, repo_id: str, *, private: bool = True, commit_message: str = "POD adaptation",
                token: str | None = None, endpoint: str | None = None) -> str:
    """Create ``repo_id`` if needed and upload ``export_dir``; returns the commit URL."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    export_dir = Path(export_dir)
    if not (export_dir / "config.json").is_file():
        raise HubPushError(f"export_dir={str(export_dir)!r} holds no config.json: run the export stage first")
    token = resolve_token(token)
    check_export_is_clean(export_dir, token)
    endpoint = endpoint or constants.ENDPOINT
    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(folder_path=str(export_dir), repo_id=repo_id, repo_type="model",
                                 commit_message=commit_message)
    except OfflineModeIsEnabled:
        raise HubPushError("offline mode is on (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE): unset it to push; "
                           "the local export is intact") from None
    except HfHubHTTPError as error:
        status = getattr(error.response, "status_code", None)
        if status in (401, 403):
            raise HubPushError(f"the Hub at {endpoint} rejected the token ({status}): check HF_TOKEN or `hf auth login` "
                               f"and write access to {repo_id}; the local export at {export_dir} is intact") from None
        raise HubPushError(f"the Hub at {endpoint} answered {status} while pushing {repo_id}: "
                           f"{_scrub(str(error), token).splitlines()[0]}; the local export at {export_dir} is intact") from None
    except (OSError, ConnectionError) as error:
        raise HubPushError(f"cannot reach the Hub at {endpoint} ({type(error).__name__}): check HF_ENDPOINT and the "
                           f"network; the local export at {export_dir} is intact") from None
    except Exception as error:  # httpx2 transport errors do not derive from OSError
        if "connect" in type(error).__name__.lower() or "connect" in str(error).lower():
            raise HubPushError(f"cannot reach the Hub at {endpoint} ({type(error).__name__}): check HF_ENDPOINT and "
                               f"the network; the local export at {export_dir} is intact") from None
        raise
    return str(getattr(info, "commit_url", info))


def _scrub(text: str, token: str) -> str:
    return text.replace(token, "<token>")
