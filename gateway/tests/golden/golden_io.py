"""What the golden scripts share: the one HTTP call the capture scripts make to a running pod (POST a JSON body;
the raw bytes come back, recorded exactly as they came), and writing a golden file next to the scripts."""
import http.client
import json
import os
import urllib.parse


def write_golden(name, data, compact=False):
    """Writes `data` as JSON to NAME next to this file; returns its path."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    with open(path, "w") as f:
        if compact:
            json.dump(data, f, separators=(",", ":"), ensure_ascii=False)
        else:
            json.dump(data, f, indent=1)
        f.write("\n")
    return path


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
