"""The one HTTP call the golden capture scripts make to a running pod: POST a JSON body, return the status, the
content type and the raw bytes (the scripts record bytes exactly as they came)."""
import http.client
import json
import urllib.parse


def post_raw(base, path, body, timeout=600):
    u = urllib.parse.urlparse(base)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    c.request("POST", path, body=json.dumps(body) if body is not None else None,
              headers={"content-type": "application/json"})
    r = c.getresponse()
    return r.status, r.getheader("content-type"), r.read()


def post(base, path, body):
    """The JSON answer of a request that must succeed (None for an empty body)."""
    status, _, data = post_raw(base, path, body)
    assert 200 <= status < 300, (path, status, data)
    return json.loads(data) if data else None
