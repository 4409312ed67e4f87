"""Prompt sets at scale: results files written as prompts finish (resumable), a prompt set's
decoder, and the same decoding on a Ray cluster (the optional extra `specgen[ray]`)."""
