"""Test helpers in one place: real server processes (:mod:`.servers`), a fake CHP
server for the client (:mod:`.fake_server`), a hostile one that sends oversized
messages (:mod:`.hostile_server`, run as its own process), a raw CHP peer for the server
(:mod:`.chp_peer`), free ports (:mod:`.ports`), socket tracking
(:mod:`.tracking`), the shared Spark session (:mod:`.spark_session`) and
:func:`.waiting.eventually`."""
