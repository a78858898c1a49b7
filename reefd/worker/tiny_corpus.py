"""The text the tiny model's BPE tokenizer is trained on: agent prose, tool schemas, code.

Owns fixed text only (every build trains on the same bytes). It is written to look like
what coding agents send (system prompts, JSON tool schemas, shell, diffs, Python, TypeScript),
so such prompts compress to ~3 bytes a token. Knows nothing about tokenizers or models.
"""

from __future__ import annotations

import json
from typing import Any

PROSE = """\
You are an interactive command line assistant that helps people with software engineering work.
Use the instructions below and the tools available to you to assist the user. Be careful, be honest,
and be concise. When you are not sure about something, say so and explain what you would check next.

# Tone and style
Keep answers short unless the user asks for detail. Your output is shown in a terminal, so plain text
and simple Markdown work best. Do not add a preamble or a summary that repeats what you just did.
Answer the question that was asked, and stop. One word answers are fine when one word is enough.
Never invent file names, function names or command line flags; read the code or the documentation first.
If you cannot or will not help with something, say so briefly and offer an alternative when one exists.
Only use emojis if the user explicitly asks for them. Prefer complete sentences over fragments.

# Proactiveness
You may take actions when the user asks you to, but do not surprise them. Strike a balance between
doing the right thing when asked, including follow-up actions, and not taking actions the user did not
ask for. If the user asks how to approach a task, answer the question first; do not jump into edits.

# Following conventions
Before you change a file, understand its conventions. Look at neighbouring files, imports, the test
layout and the build configuration. Mimic the existing code style, use the existing libraries and
utilities, and follow the existing patterns. Never assume that a library is available, even a well
known one: check the package manifest (package.json, pyproject.toml, requirements.txt, Cargo.toml,
go.mod, pom.xml, build.gradle) or the imports of nearby modules first. When you create a new component,
look at how existing components are written: framework choice, naming, typing, error handling.
Always follow security best practices. Never write code that logs or exposes secrets, keys or tokens,
and never commit them to the repository.

# Code style
Do not add comments that only restate what the code does. Add a comment when the reason is not obvious.
Prefer small functions with clear names, early returns, and explicit error handling. Keep public
interfaces typed. Delete dead code instead of commenting it out.

# Doing tasks
The user will mostly ask you to fix bugs, add features, refactor code, explain code, and write tests.
For these tasks the following steps are recommended:
1. Plan the work with the todo list tool when the task has several steps.
2. Search the code base to understand the problem and the surrounding code. Use the search tools
   extensively, both in parallel and one after the other.
3. Implement the solution with the tools available to you.
4. Verify the solution with tests. Never assume a particular test framework or test script; read the
   README or search the code base to find the testing approach.
5. When you have finished, run the lint and type check commands (for example npm run lint, ruff check,
   mypy, cargo clippy, go vet) if they were provided, to make sure your code is correct.
Never commit changes unless the user explicitly asks you to. It is very important to only commit when
asked, otherwise the user will feel that you are being too proactive.

# Tool usage policy
When several independent pieces of information are requested, batch your tool calls together for the
best performance. When you make several bash calls that do not depend on each other, send them in a
single message so that they run in parallel. Prefer the dedicated file tools over shell commands: use
the read tool instead of cat, head or tail; the edit tool instead of sed or awk; the write tool instead
of echo with redirection; the search tool instead of grep or find. Reserve the shell for running
programs, tests, builds, package managers and version control.
Tool results and user messages may include system reminders. They contain useful information and
context; they bear no direct relation to the specific tool result or message in which they appear.

# Task management
You have access to a todo list tool to help you manage and plan tasks. Use it very frequently to track
your progress and to give the user visibility into it. It is also extremely helpful for planning and
for breaking larger complex tasks into smaller steps. If you do not use it when planning, you may
forget important tasks, and that is unacceptable. Mark todos as completed as soon as you are done with
a task; do not batch up several tasks before marking them as completed. Exactly one task should be in
progress at any time.

# Committing changes with git
When the user asks you to create a new git commit, follow these steps carefully:
- Run git status to see all untracked files, git diff to see both staged and unstaged changes, and
  git log to see recent commit messages so that you can follow this repository's commit message style.
- Analyse all staged changes and draft a commit message: summarise the nature of the changes (a new
  feature, an enhancement, a bug fix, a refactoring, a test, documentation), focus on why rather than
  what, and keep it to one or two sentences. Do not commit files that are likely to contain secrets.
- Add the relevant untracked files to the staging area, create the commit, and run git status to make
  sure that the commit succeeded. If the commit fails because of pre-commit hook changes, retry once.
- Never update the git config, never run destructive git commands (push --force, hard reset, clean)
  unless the user explicitly requests them, and never skip hooks (--no-verify).
- Never use git commands with the -i flag (git rebase -i, git add -i): they need interactive input.
- If there are no changes to commit, do not create an empty commit.

# Creating pull requests
Use the gh command for all GitHub related tasks, including issues, pull requests, checks and releases.
Understand the current state of the branch since it diverged from the main branch: check whether it
tracks a remote branch and is up to date, then look at the full commit history and the diff. Draft a
title and a summary with a short test plan, push the branch with -u if needed, and create the pull
request. Return the pull request URL when you are done so that the user can see it.

# Environment
Working directory: /home/user/projects/service
Is directory a git repository: yes
Platform: linux
OS version: Linux 6.8.0-45-generic
Today's date: 2025-06-14
Model: a large language model with a knowledge cutoff in early 2025.

# Security
Assist with defensive security tasks only. Refuse to create, modify or improve code that may be used
maliciously. Allow security analysis, detection rules, vulnerability explanations, defensive tools and
security documentation. Never generate or guess URLs unless you are confident that they help the user
with programming; you may use URLs that the user provided in their messages or in local files.

# Code references
When referencing specific functions or pieces of code, include the pattern file_path:line_number so
that the user can easily navigate to the source code location, for example: clients are marked as
failed in the connect function in src/services/process.ts:712.

The user is working on a web service written in Python and TypeScript. The back end uses FastAPI,
SQLAlchemy and PostgreSQL; the front end uses React, Vite and Tailwind. Tests run with pytest and
vitest. The continuous integration pipeline runs on GitHub Actions and deploys containers to a
Kubernetes cluster. Configuration is read from environment variables and from a YAML file.
Questions usually concern authentication, database migrations, background jobs, caching, rate limits,
logging, metrics, error messages, performance, memory usage, timeouts, retries and concurrency.
An agent asks, the engine answers, the record keeps the tokens, the recipe learns. Each request has a
model, a list of messages, optional tools, a temperature, a maximum number of tokens and a stream flag.
The response contains a message with text content or tool calls, a finish reason and the token usage.
"""

TOOLS: list[dict[str, Any]] = [
    {
        "name": "Shell",
        "description": (
            "Executes a given shell command in a persistent session with an optional timeout, with proper "
            "handling and security measures.\n\nBefore executing the command, follow these steps:\n"
            "1. Directory verification: if the command will create new directories or files, first use the "
            "list tool to verify that the parent directory exists and is the correct location.\n"
            "2. Command execution: always quote file paths that contain spaces with double quotes.\n\n"
            "Usage notes:\n - The command argument is required.\n - You can specify an optional timeout in "
            "milliseconds (up to 600000ms / 10 minutes). If not specified, commands time out after 120000ms.\n"
            " - If the output exceeds 30000 characters, it will be truncated before being returned to you.\n"
            " - Avoid search commands like find and grep; use the search tools instead.\n"
            " - When issuing multiple commands, use the ';' or '&&' operator to separate them."
        ),
        "parameters": {
            "command": ("string", "The command to execute"),
            "timeout": ("number", "Optional timeout in milliseconds (max 600000)"),
            "description": ("string", "Clear, concise description of what this command does in 5-10 words."),
            "run_in_background": ("boolean", "Set to true to run this command in the background."),
        },
        "required": ["command"],
    },
    {
        "name": "ReadFile",
        "description": (
            "Reads a file from the local filesystem. You can access any file directly by using this tool. "
            "Assume this tool is able to read all files on the machine. If the user provides a path to a file, "
            "assume that path is valid. It is okay to read a file that does not exist; an error will be returned.\n"
            "Usage:\n- The file_path parameter must be an absolute path, not a relative path.\n"
            "- By default, it reads up to 2000 lines starting from the beginning of the file.\n"
            "- You can optionally specify a line offset and limit, which is handy for long files.\n"
            "- Any lines longer than 2000 characters will be truncated.\n"
            "- Results are returned using cat -n format, with line numbers starting at 1.\n"
            "- This tool can read images (PNG, JPG), PDF files and Jupyter notebooks (.ipynb files)."
        ),
        "parameters": {
            "file_path": ("string", "The absolute path to the file to read"),
            "offset": ("number", "The line number to start reading from"),
            "limit": ("number", "The number of lines to read"),
        },
        "required": ["file_path"],
    },
    {
        "name": "EditFile",
        "description": (
            "Performs exact string replacements in files.\n\nUsage:\n- You must use the read tool at least "
            "once in the conversation before editing. This tool will error if you attempt an edit without "
            "reading the file.\n- When editing text, ensure you preserve the exact indentation (tabs/spaces) "
            "as it appears after the line number prefix.\n- ALWAYS prefer editing existing files in the "
            "codebase. NEVER write new files unless explicitly required.\n- The edit will FAIL if old_string "
            "is not unique in the file. Either provide a larger string with more surrounding context to make "
            "it unique or use replace_all to change every instance of old_string."
        ),
        "parameters": {
            "file_path": ("string", "The absolute path to the file to modify"),
            "old_string": ("string", "The text to replace"),
            "new_string": ("string", "The text to replace it with (must be different from old_string)"),
            "replace_all": ("boolean", "Replace all occurrences of old_string (default false)"),
        },
        "required": ["file_path", "old_string", "new_string"],
    },
    {
        "name": "WriteFile",
        "description": (
            "Writes a file to the local filesystem. This tool will overwrite the existing file if there is one "
            "at the provided path. If this is an existing file, you MUST read it first. Never proactively create "
            "documentation files (*.md) or README files unless explicitly requested by the user."
        ),
        "parameters": {
            "file_path": ("string", "The absolute path to the file to write (must be absolute, not relative)"),
            "content": ("string", "The content to write to the file"),
        },
        "required": ["file_path", "content"],
    },
    {
        "name": "FindFiles",
        "description": (
            "Fast file pattern matching tool that works with any codebase size. Supports glob patterns like "
            '"**/*.js" or "src/**/*.ts". Returns matching file paths sorted by modification time. Use this '
            "tool when you need to find files by name patterns."
        ),
        "parameters": {
            "pattern": ("string", "The glob pattern to match files against"),
            "path": ("string", "The directory to search in. Defaults to the current working directory."),
        },
        "required": ["pattern"],
    },
    {
        "name": "SearchText",
        "description": (
            'A powerful search tool built on ripgrep. Supports full regex syntax (e.g. "log.*Error", '
            '"function\\\\s+\\\\w+"). Filter files with the glob parameter (e.g. "*.js", "**/*.tsx") or the type '
            'parameter (e.g. "js", "py", "rust"). Output modes: "content" shows matching lines, '
            '"files_with_matches" shows only file paths (default), "count" shows match counts.'
        ),
        "parameters": {
            "pattern": ("string", "The regular expression pattern to search for in file contents"),
            "path": ("string", "File or directory to search in. Defaults to current working directory."),
            "glob": ("string", 'Glob pattern to filter files (e.g. "*.js", "*.{ts,tsx}")'),
            "output_mode": ("string", 'Output mode: "content", "files_with_matches" or "count"'),
            "-i": ("boolean", "Case insensitive search"),
            "-n": ("boolean", "Show line numbers in output. Requires output_mode: content"),
            "head_limit": ("number", "Limit output to the first N lines or entries"),
            "multiline": ("boolean", "Enable multiline mode where . matches newlines"),
        },
        "required": ["pattern"],
    },
    {
        "name": "TodoList",
        "description": (
            "Use this tool to create and manage a structured task list for your current coding session. This "
            "helps you track progress, organize complex tasks, and demonstrate thoroughness to the user. It also "
            "helps the user understand the progress of the task and the progress of their requests overall.\n\n"
            "## When to Use This Tool\n1. Complex multi-step tasks - when a task requires 3 or more distinct "
            "steps or actions\n2. Non-trivial and complex tasks - tasks that require careful planning\n"
            "3. User explicitly requests a todo list\n4. User provides multiple tasks (numbered or comma-separated)"
            "\n\n## When NOT to Use This Tool\n1. There is only a single, straightforward task\n"
            "2. The task is trivial and tracking it provides no organizational benefit"
        ),
        "parameters": {
            "todos": ("array", "The updated todo list, each item with content, status and id"),
        },
        "required": ["todos"],
    },
    {
        "name": "FetchUrl",
        "description": (
            "Fetches content from a specified URL and processes it using an AI model. Takes a URL and a prompt "
            "as input, fetches the URL content, converts HTML to markdown, and returns the model's response "
            "about the content.\nUsage notes:\n - The URL must be a fully-formed valid URL\n - HTTP URLs will "
            "be automatically upgraded to HTTPS\n - This tool is read-only and does not modify any files\n"
            " - Results may be summarized if the content is very large"
        ),
        "parameters": {
            "url": ("string", "The URL to fetch content from"),
            "prompt": ("string", "The prompt to run on the fetched content"),
        },
        "required": ["url", "prompt"],
    },
    {
        "name": "RunSubagent",
        "description": (
            "Launch a new agent to handle complex, multi-step tasks autonomously. Available agent types and the "
            "tools they have access to: general-purpose: a general agent for researching complex questions, "
            "searching for code, and executing multi-step tasks. When you are searching for a keyword or file "
            "and are not confident that you will find the right match in the first few tries, use this agent."
        ),
        "parameters": {
            "description": ("string", "A short (3-5 word) description of the task"),
            "prompt": ("string", "The task for the agent to perform"),
            "subagent_type": ("string", "The type of specialized agent to use for this task"),
        },
        "required": ["description", "prompt", "subagent_type"],
    },
]

CODE = '''\
import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)


@dataclass
class Settings:
    """Application settings, read from the environment."""

    database_url: str = "postgresql://localhost:5432/app"
    redis_url: str = "redis://localhost:6379/0"
    timeout_s: float = 30.0
    retries: int = 3
    debug: bool = False
    tags: list[str] = field(default_factory=list)


class NotFoundError(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(f"item {key!r} was not found")
        self.key = key


async def fetch_user(session: Any, user_id: int) -> Optional[dict[str, Any]]:
    async with session.get(f"/api/v1/users/{user_id}", timeout=10) as response:
        if response.status == 404:
            return None
        response.raise_for_status()
        return await response.json()


def load_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise FileNotFoundError(path)
    with path.open(encoding="utf-8") as handle:
        data = json.load(handle)
    for key, value in data.items():
        logger.debug("config %s = %r", key, value)
    return data


def test_load_config(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"name": "demo", "port": 8080}))
    assert load_config(path)["port"] == 8080


if __name__ == "__main__":
    asyncio.run(main())
'''

TYPESCRIPT = """\
import { useEffect, useState } from "react";
import type { Request, Response } from "express";

export interface User {
  id: number;
  name: string;
  email: string;
  roles: string[];
  createdAt?: Date;
}

export async function getUser(id: number): Promise<User | null> {
  const response = await fetch(`/api/users/${id}`, { headers: { "Content-Type": "application/json" } });
  if (!response.ok) {
    throw new Error(`Request failed with status ${response.status}`);
  }
  return (await response.json()) as User;
}

export function useUsers(): { users: User[]; loading: boolean; error: string | null } {
  const [users, setUsers] = useState<User[]>([]);
  const [loading, setLoading] = useState(true);
  const [error, setError] = useState<string | null>(null);
  useEffect(() => {
    fetch("/api/users")
      .then((res) => res.json())
      .then((data) => setUsers(data.items ?? []))
      .catch((err: unknown) => setError(String(err)))
      .finally(() => setLoading(false));
  }, []);
  return { users, loading, error };
}

export const handler = async (req: Request, res: Response): Promise<void> => {
  const { page = "1", limit = "20" } = req.query as Record<string, string>;
  res.status(200).json({ page: Number(page), limit: Number(limit), items: [] });
};
"""

SHELL = """\
$ git status
On branch main
Your branch is up to date with 'origin/main'.

Changes not staged for commit:
  (use "git add <file>..." to update what will be committed)
	modified:   src/api/routes.py
	modified:   tests/test_routes.py

Untracked files:
	docs/notes.md

$ git log --oneline -3
a1b2c3d Fix the retry loop in the job runner
e4f5a6b Add pagination to the users endpoint
0f9e8d7 Update dependencies

$ git diff src/api/routes.py
diff --git a/src/api/routes.py b/src/api/routes.py
index 3f2a1b0..8c7d6e5 100644
--- a/src/api/routes.py
+++ b/src/api/routes.py
@@ -12,7 +12,9 @@ from fastapi import APIRouter, Depends, HTTPException
 router = APIRouter(prefix="/api/v1")
-@router.get("/users/{user_id}")
+@router.get("/users/{user_id}", response_model=UserOut)
 async def read_user(user_id: int, db: Session = Depends(get_db)) -> UserOut:
-    return db.get(User, user_id)
+    user = db.get(User, user_id)
+    if user is None:
+        raise HTTPException(status_code=404, detail="User not found")
+    return user

$ ls -la
total 48
drwxr-xr-x  8 user user 4096 Jun 14 10:02 .
-rw-r--r--  1 user user  812 Jun 14 09:58 package.json
-rw-r--r--  1 user user 1204 Jun 14 09:58 pyproject.toml
-rw-r--r--  1 user user 3321 Jun 14 09:58 README.md
drwxr-xr-x  4 user user 4096 Jun 14 10:01 src
drwxr-xr-x  3 user user 4096 Jun 14 10:01 tests

$ python -m pytest -q tests/test_routes.py
....F.                                                                   [100%]
FAILED tests/test_routes.py::test_read_missing_user - AssertionError: assert 500 == 404
1 failed, 5 passed in 0.42s
$ npm run build && npm test -- --watch=false
$ docker compose up -d --build && kubectl get pods -n staging
"""

MARKUP = """\
# Project notes

## Commands
- `make install`: install the dependencies into `.venv`
- `make test`: run the unit tests (`pytest -q`)
- `npm run dev`: start the front end on http://localhost:5173

## Conventions
* Use type hints everywhere; run `mypy --strict` before you push.
* Keep functions short; prefer pure functions and dependency injection.
* Every endpoint has a test; every bug fix comes with a regression test.

```yaml
name: ci
on: [push, pull_request]
jobs:
  test:
    runs-on: ubuntu-latest
    steps:
      - uses: actions/checkout@v4
      - run: pip install -e ".[dev]" && pytest -q
```

<system-reminder>
As you answer the user's questions, you can use the following context. This context may or may not be
relevant to your tasks. You should not respond to this context unless it is highly relevant.
</system-reminder>
<tool_call>
{"name": "ReadFile", "arguments": {"file_path": "/home/user/projects/service/src/api/routes.py"}}
</tool_call>
<tool_response>
     1\timport logging
     2\tfrom fastapi import APIRouter
</tool_response>
{"role": "user", "content": [{"type": "text", "text": "Why does the test fail?"}]}
{"id": "call_01", "type": "function", "function": {"name": "Shell", "arguments": "{\\"command\\": \\"ls\\"}"}}
Hello! How are you today? I am fine, thank you. What is the capital of France? Paris.
What is 2 + 2? It is 4. Count: one, two, three, four, five, six, seven, eight, nine, ten.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Continual learning: serve, observe, grow, commit. Scores, feedback and references.
Numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000, punctuation . , ; : ! ? ( ) [ ] { } " ' - _ / \\\\ @ # $ % & *
Ünïcödé: café, naïve, Zürich, 東京, Привет, 🙂 — all bytes are tokens, nothing is unknown.
"""


def tool_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """One of `TOOLS` as an OpenAI function tool (the shape chat templates render)."""
    props = {name: {"type": kind, "description": text} for name, (kind, text) in tool["parameters"].items()}
    parameters = {
        "type": "object",
        "properties": props,
        "required": tool["required"],
        "additionalProperties": False,
        "$schema": "http://json-schema.org/draft-07/schema#",
    }
    return {
        "type": "function",
        "function": {"name": tool["name"], "description": tool["description"], "parameters": parameters},
    }


# Common English and programming words not elsewhere above, so unseen prose still compresses.
WORDS = """\
the of and to in is it you that he was for on are with as his they be at one have this from or had by
word but what some we can out other were all there when up use your how said an each she which do their
time if will way about many then them write would like so these her long make thing see him two has look
more day could go come did number sound no most people my over know water than call first who may down
side been now find any new work part take get place made live where after back little only round man year
came show every good me give our under name very through just form sentence great think say help low line
differ turn cause much mean before move right boy old too same tell does set three want air well also play
small end put home read hand port large spell add even land here must big high such follow act why ask men
change went light kind off need house picture try us again animal point mother world near build self earth
father head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw far sea
draw left late run while press close night real life few north open seem together next white children begin
got walk example ease paper group always music those both mark often letter until mile river car feet care
second book carry took science eat room friend began idea fish mountain stop once base hear horse cut sure
watch color face wood main enough plain girl usual young ready above ever red list though feel talk bird
soon body dog family direct pose leave song measure door product black short numeral class wind question
happen complete ship area half rock order fire south problem piece told knew pass since top whole king space
heard best hour better true during hundred five remember step early hold west ground interest reach fast verb
sing listen six table travel less morning ten simple several vowel toward war lay against pattern slow center
love person money serve appear road map rain rule govern pull cold notice voice unit power town fine certain
fly fall lead cry dark machine note wait plan figure star box noun field rest correct able pound done beauty
drive stood contain front teach week final gave green oh quick develop ocean warm free minute strong special
mind behind clear tail produce fact street inch multiply nothing course stay wheel full force blue object
decide surface deep moon island foot system busy test record boat common gold possible plane stead dry wonder
laugh thousand ago ran check game shape equate hot miss brought heat snow tire bring yes distant fill east
paint language among grand ball yet wave drop heart present heavy dance engine position arm wide sail
material size vary settle speak weight general ice matter circle pair include divide syllable felt perhaps
pick sudden count square reason length represent art subject region energy hunt probable bed brother egg
ride cell believe fraction forest sit race window store summer train sleep prove lone exercise wall catch
mount wish sky board joy winter sat written wild instrument kept glass grass cow job edge sign visit past
soft fun bright gas weather month million bear finish happy hope flower clothe strange gone jump baby eight
village meet root buy raise solve metal whether push seven paragraph third shall held hair describe cook
floor either result burn hill safe cat century consider type law bit coast copy phrase silent tall sand soil
roll temperature finger industry value fight lie beat excite natural view sense ear else quite broke case
middle kill son lake moment scale loud spring observe child straight consonant nation dictionary milk speed
method organ pay age section dress cloud surprise quiet stone tiny climb cool design poor lot experiment
bottom key iron single stick flat twenty skin smile crease hole trade melody trip office receive row mouth
exact symbol die least trouble shout except wrote seed tone join suggest clean break lady yard rise bad blow
oil blood touch grew cent mix team wire cost lost brown wear garden equal sent choose fell fit flow fair bank
collect save control decimal gentle woman captain practice separate difficult doctor please protect noon
whose locate ring character insect caught period indicate radio spoke atom human history effect electric
expect crop modern element hit student corner party supply bone rail imagine provide agree thus capital
chair danger fruit rich thick soldier process operate guess necessary sharp wing create neighbor wash bat
rather crowd corn compare poem string bell depend meat rub tube famous dollar stream fear sight thin triangle
planet hurry chief colony clock mine tie enter major fresh search send yellow gun allow print dead spot
desert suit current lift rose continue block chart hat sell success company subtract event particular deal
swim term opposite wife shoe shoulder spread arrange camp invent cotton born determine quart nine truck noise
level chance gather shop stretch throw shine property column molecule select wrong gray repeat require broad
prepare salt nose plural anger claim continent oxygen sugar death pretty skill women season solution magnet
silver thank branch match suffix especially fig afraid huge sister steel discuss forward similar guide
experience score apple bought led pitch coat mass card band rope slip win dream evening condition feed tool
total basic smell valley nor double seat arrive master track parent shore division sheet substance favor
connect post spend chord fat glad original share station dad bread charge proper bar offer segment slave
duck instant market degree populate chick dear enemy reply drink occur support speech nature range steam
motion path liquid log meant quotient teeth shell neck
abstract argument array assert async attribute await boolean branch buffer bytes callback channel client
closure commit compile component concurrency config constant constructor container context cursor daemon
database debug declare decorator default define delete dependency deploy deprecated dictionary directory
dispatch docker element encode endpoint enum environment error exception execute export extend factory
fetch filter float format function generator generic getter handler hash header heap import index inherit
initialize inline input instance integer interface iterator kernel keyword lambda latency library lint
literal locale lock logger loop merge metadata method middleware migration module mutable namespace null
optional output override package parameter parse payload pipeline pointer private promise property protocol
proxy public query queue recursion refactor reference regex register release render repository request
resolve response return router runtime schema scope script serialize server session setter signature slice
socket source stack statement static stream struct subprocess syntax template thread throw timeout token
trace transaction tuple typed undefined unicode update upload validate variable vector version virtual
webhook widget wrapper yield
"""


def corpus() -> list[str]:
    """The training text: whole sections, so newlines and indentation are learned too."""
    schemas = [json.dumps(tool_schema(t)) for t in TOOLS]
    return [*PROSE.split("\n\n"), *schemas, CODE, TYPESCRIPT, SHELL, MARKUP, WORDS]
