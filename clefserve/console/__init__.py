"""The browser console's static files (HTML, CSS, JavaScript modules), served at ``/`` by
:mod:`clefserve.server.console`. Plain files: no build step, no CDN, nothing fetched from elsewhere."""
