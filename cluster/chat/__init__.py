"""Text <-> tokens at the API edge: what a chat becomes, and what a reply is.

    template.py     chat prompts: the checkpoint's Jinja template, else DeepSeek-V4's format, else plain
    dsv4_encode.py  DeepSeek-V4's chat format (thinking, reasoning_effort, tools, DSML), implemented here;
                    its segments tell markup from client text, which is tokenized as text
    dsv4_parse.py   a V4 reply parsed as it streams: reasoning_content, content, tool_calls
    dsv4_grammar.py the grammar a forced tool call follows (xgrammar EBNF)
    json_schema.py  what of a JSON schema the grammar enforces: checked first, the rest a 400 naming the keyword
    detokenizer.py  incremental detokenization with stop strings
"""
