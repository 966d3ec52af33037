// Package tables holds the agent's statedb schema: the object types of every
// table, their indexes, their TableHeader/TableRow columns and the
// constructors that register them. Cells own the tables (they hold the
// RWTable); everything else reads them. No logic lives here beyond small
// methods on the objects.
package tables
