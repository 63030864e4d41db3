"""Values that hold secrets keep them out of their repr (a settings or activation line may be
logged): what ``repr=False`` did on their dataclass fields, now that they are msgspec Structs."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from guard.tokens import StaticToken
from registry.record import EngineSpec
from runtime_agent.settings import Settings
from runtime_agent.supervision.pool import Activation

# A generated secret may by chance be a substring of some other field's value ("sglang.launc"
# is in the default SGLang command), so each carries a marker no field holds, and the repr is
# also checked to be the same whatever the secret is.
SECRET = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=12,
                 max_size=40).map(lambda text: f"SECRET\u2063{text}")


@given(SECRET, SECRET)
def test_the_settings_repr_shows_every_field_but_the_tokens(hf: str, api: str) -> None:
    settings = Settings(state_dir=Path("/tmp/x"), hf_token=hf, api_token=StaticToken(api))
    text = repr(settings)
    assert hf not in text and api not in text
    other = Settings(state_dir=Path("/tmp/x"), hf_token="other-hf",
                     api_token=StaticToken("other-api-token"))
    assert text == repr(other)
    assert "hf_token" not in text and "api_token" not in text
    shown = set(Settings.__struct_fields__) - {"hf_token", "api_token"}
    assert all(f"{name}=" in text for name in shown)
    assert text.startswith("Settings(") and "state_dir=PosixPath('/tmp/x')" in text


@given(SECRET)
def test_an_activation_repr_leaves_its_credentials_out(secret: str) -> None:
    spec = EngineSpec(model_name="m", artifact_url="hf://org/m", ipc_name="kvc_m")
    activation = Activation(spec, port=20001,
                            credentials={"HF_TOKEN": secret})
    text = repr(activation)
    assert secret not in text and "credentials" not in text
    assert text == repr(Activation(spec, port=20001, credentials={"HF_TOKEN": "other"}))
    assert "port=20001" in text and "model_name='m'" in text
    assert activation.credentials == {"HF_TOKEN": secret}  # kept, only not shown
