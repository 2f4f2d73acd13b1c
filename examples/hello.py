"""The quickstart's job: an RQ worker started with PYTHONPATH=examples imports and runs it."""


def send_email(address: str) -> str:
    print(f"sending a welcome email to {address}")
    return f"sent to {address}"
